"""A checkpoint file changed under a running daemon: noticed, refused in one line, never mixed.

Real ``k3d start`` subprocesses serve a two-shard safetensors checkpoint (layers 0-1 in
shard 1, 2-3 in shard 2) with a small arena, so experts are read again and again;
real clients compare every byte they are served with the original files (read by
``safetensors.safe_open`` before anything changes).  The shard is changed the ways a
user does: ``cp`` of another checkpoint's shard over it (a write in place, same size:
only mtime and the bytes differ), ``mv`` of a new file over it (another inode), and a
slow in-place rewrite while clients fetch (a read that a write reaches must fail, not
be served).  A GGUF file and a packed file are overwritten in place too.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import threading

import numpy as np
import pytest

import k3client
from helpers import expert_bytes, k3ctl, k3d, poll_for, reference
from k3d.demo.synthetic import write_checkpoint, write_synthetic_gguf

SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"


@pytest.fixture
def ckpts(tmp_path):
    """The served checkpoint and another of the same shapes (other values)."""
    served = write_checkpoint(str(tmp_path / "served"), layers=4, experts=8, hidden=256, inter=128,
                              shards=2, seed=3)
    other = write_checkpoint(str(tmp_path / "other"), layers=4, experts=8, hidden=256, inter=128,
                             shards=2, seed=4)
    return served, other


def image(client, ex) -> bytes:
    """A fetched expert as a slot image: every layout tensor's bytes at its offset."""
    end = max(s.offset + s.nbytes for s in client.layout)
    buf = bytearray(end)
    for spec in client.layout:
        buf[spec.offset:spec.offset + spec.nbytes] = ex.array(spec.name).tobytes()
    return bytes(buf)


def expect_changed(client, layer, expert, path):
    with pytest.raises(k3client.ReadFailed) as e:
        client.fetch(layer, [expert])
    msg = str(e.value)
    assert "\n" not in msg
    assert f"source file {path} changed while served" in msg, msg
    assert "restart k3d" in msg, msg
    return msg


def serve_checked(client, ref, layer, experts):
    got = client.fetch(layer, experts)
    for ex in got:
        assert image(client, ex) == expert_bytes(ref, client.layout, (layer, ex.expert)), (layer, ex.expert)


def test_cp_over_a_shard_fails_its_reads_and_serves_the_other(ckpts, start_daemon):
    served, other = ckpts
    ref = reference(served)
    d = start_daemon(served, "--slots", "8")      # room for all 7 experts served below
    shard1 = os.path.join(served, SHARD1)
    with k3client.connect(d.endpoint, timeout=10) as c:
        serve_checked(c, ref, 0, [0, 1])          # resident from the old bytes
        serve_checked(c, ref, 2, [0, 1])
        c.begin_token()
        subprocess.run(["cp", os.path.join(other, SHARD1), shard1], check=True)   # in place, same size
        msg = expect_changed(c, 1, 5, shard1)
        assert "mtime" in msg, msg                # the size is the same: only mtime tells
        expect_changed(c, 0, 7, shard1)           # and it stays so
        serve_checked(c, ref, 3, [2, 3, 4])       # the other shard still serves, byte for byte
        serve_checked(c, ref, 0, [0, 1])          # resident experts stay: whole old bytes
        c.begin_token()
        assert c.status()["source_changed"] == [msg.split(": ", 1)[1]]
    r = k3ctl("status", "--endpoint", d.endpoint)
    assert f"CHANGED source file {shard1} changed while served" in r.stdout, r.stdout
    log = d.log()
    assert log.count(f"source file {shard1} changed while served") == 1, log
    assert d.proc.poll() is None
    assert d.stop() == 0


def test_mv_over_a_shard_is_a_replaced_file(ckpts, start_daemon):
    served, other = ckpts
    ref = reference(served)
    d = start_daemon(served, "--slots", "6")
    shard2 = os.path.join(served, SHARD2)
    with k3client.connect(d.endpoint, timeout=10) as c:
        serve_checked(c, ref, 2, [0])
        tmp = shard2 + ".new"
        shutil.copyfile(os.path.join(other, SHARD2), tmp)
        os.replace(tmp, shard2)                   # `mv`: the daemon's descriptor keeps the old inode
        # noticed within a second (the path is stat'ed once a second); until then a read
        # still serves the old inode's bytes, whole
        refused = []

        keys = itertools.cycle([(layer, e) for e in range(8) for layer in (2, 3)])   # more than the arena

        def refused_or_old():
            layer, expert = next(keys)
            try:
                serve_checked(c, ref, layer, [expert])
            except k3client.ReadFailed as err:
                refused.append(str(err))
            c.begin_token()
            return refused

        poll_for(refused_or_old, 5, "the replaced shard to be noticed", interval=0.2)
        msg = refused[0]
        assert f"source file {shard2} changed while served (replaced: inode" in msg, msg
        poll_for(lambda: len(refused_or_old()) >= 3, 5, "more refusals")      # and it stays so
        assert all("replaced: inode" in m for m in refused), refused
        serve_checked(c, ref, 1, [3, 4])          # shard 1 serves on
    assert d.stop() == 0


def test_a_rewrite_during_reads_is_never_served_as_a_mix(ckpts, start_daemon):
    """Two clients fetch shard 1's experts through a 4-slot arena while the shard is rewritten
    in place, 64 KiB at a time, with the other checkpoint's bytes: every expert served is
    the old one, whole; every refusal is the one-line message."""
    served, other = ckpts
    ref = reference(served)
    d = start_daemon(served, "--slots", "4", "--predict", "off")
    shard1 = os.path.join(served, SHARD1)
    with open(os.path.join(other, SHARD1), "rb") as f:
        new = f.read()
    stop = threading.Event()
    served_n, refused, wrong, errors = [0], [0], [], []

    def client(seed):
        rng = np.random.default_rng(seed)
        try:
            with k3client.connect(d.endpoint, timeout=20) as c:
                while not stop.is_set():
                    layer, e = int(rng.integers(0, 2)), int(rng.integers(0, 8))
                    try:
                        (ex,) = c.fetch(layer, [e])
                    except k3client.ReadFailed as err:
                        assert f"source file {shard1} changed while served" in str(err), err
                        refused[0] += 1
                    else:
                        if image(c, ex) != expert_bytes(ref, c.layout, (layer, e)):
                            wrong.append((layer, e))
                        served_n[0] += 1
                    c.begin_token()
        except Exception as e:  # noqa: BLE001 (reported by the test thread)
            errors.append(e)

    threads = [threading.Thread(target=client, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    poll_for(lambda: served_n[0] >= 20 or errors, 30, "clients serving")
    fd = os.open(shard1, os.O_WRONLY)             # in place: the inode the daemon reads
    try:
        for off in range(0, len(new), 65536):
            os.pwrite(fd, new[off:off + 65536], off)
    finally:
        os.close(fd)
    poll_for(lambda: refused[0] >= 20 or wrong or errors, 30, "fetches refused after the rewrite")
    stop.set()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert not wrong, f"served a changed expert: {wrong[:5]}"
    assert d.proc.poll() is None
    assert d.stop() == 0


@pytest.mark.parametrize("kind", ["gguf", "k3pack"])
def test_gguf_and_packed_files_written_in_place(tmp_path, start_daemon, kind):
    pytest.importorskip("gguf")
    src = str(tmp_path / "m.gguf")
    write_synthetic_gguf(src, layers=2, experts=8, seed=0)
    write_synthetic_gguf(str(tmp_path / "o.gguf"), layers=2, experts=8, seed=1)
    if kind == "k3pack":
        for name in ("m", "o"):
            r = k3d("pack", str(tmp_path / f"{name}.gguf"), str(tmp_path / f"{name}.k3pack"))
            assert r.returncode == 0, r.stderr
        src = str(tmp_path / "m.k3pack")
    d = start_daemon(src, "--slots", "4")
    with k3client.connect(d.endpoint, timeout=10) as c:
        (before,) = c.fetch(0, [0])
        old = image(c, before)
        c.begin_token()
        subprocess.run(["cp", str(tmp_path / f"o.{kind}"), src], check=True)
        expect_changed(c, 1, 6, src)
        (again,) = c.fetch(0, [0])                # resident: the old bytes, whole
        assert image(c, again) == old
    assert d.stop() == 0
