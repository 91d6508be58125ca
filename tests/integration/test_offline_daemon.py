"""Integration: ``k3d start --disk-cache`` while the HTTP origin is down (offline restart)."""

import glob
import json
import subprocess
import sys

import numpy as np
import pytest
from safetensors import safe_open

import k3client
from faulty_http import FaultyServer
from k3d.config import DEFAULT_PATTERN
from k3d.demo.synthetic import write_checkpoint


def expected(ckpt, layout, key) -> bytes:
    """The expert as a slot holds it, from the reference reader."""
    tensors = {}
    for f in glob.glob(f"{ckpt}/*.safetensors"):
        with safe_open(f, framework="numpy") as st:
            for name in st.keys():
                tensors[name] = st.get_tensor(name)
    out = bytearray(max(s.offset + s.nbytes for s in layout))
    for s in layout:
        t = tensors[DEFAULT_PATTERN.format(layer=key[0], expert=key[1], name=s.name)]
        out[s.offset:s.offset + s.nbytes] = np.ascontiguousarray(t).tobytes()
    return bytes(out)


def status(endpoint):
    r = subprocess.run([sys.executable, "-m", "k3d.commands.ctl", "status", "--endpoint", endpoint, "--json"],
                       check=False, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_daemon_restarts_offline_and_catches_up(tmp_path, start_daemon):
    write_checkpoint(str(tmp_path / "origin" / "ck"), layers=2, experts=4, shards=2, seed=5)
    srv = FaultyServer(str(tmp_path / "origin")).start()
    port, url = srv.server_address[1], srv.url + "ck/"
    cache = tmp_path / "cache"
    # the daemon's own predictions would read from the origin too, as soon as it is back and
    # as fast as this machine's load lets them: the counts below are of the client's reads
    args = ("--arena", "4MiB", "--disk-cache", cache, "--http-retries", "1", "--http-timeout", "2",
            "--predict", "client")
    d = start_daemon(url, *args)
    with k3client.connect(d.endpoint, name="warm") as c:
        want = {e.expert: bytes(e.memory()) for e in c.fetch(0, [0, 1])}
    assert d.stop() == 0                           # drains the disk writes
    srv.stop()

    d = start_daemon(url, *args, endpoint=d.endpoint)   # the origin is down: starts from the kept headers
    assert "starting from the headers kept" in d.log()
    o = status(d.endpoint)["model"]["tiers"]["origin"]
    assert o["up"] is False and "failed after" in o["error"]
    human = subprocess.run([sys.executable, "-m", "k3d.commands.ctl", "status", "--endpoint", d.endpoint],
                           check=False, capture_output=True, text=True, timeout=30).stdout
    assert "DOWN for" in human
    with k3client.connect(d.endpoint, name="offline") as c:
        got = {e.expert: bytes(e.memory()) for e in c.fetch(0, [0, 1])}
        assert got == want                          # from disk, the same bytes
        for ex, data in got.items():
            ref = expected(tmp_path / "origin" / "ck", c.layout, (0, ex))
            assert data[:len(ref)] == ref
        c.begin_token()
        with pytest.raises(k3client.ReadFailed):
            c.fetch(1, [3])
        srv = FaultyServer(str(tmp_path / "origin"), port=port).start()
        try:
            c.begin_token()
            e = c.fetch(1, [3])[0]                  # the origin answers again
            assert bytes(e.memory())[:len(expected(tmp_path / "origin" / "ck", c.layout, (1, 3)))] == \
                expected(tmp_path / "origin" / "ck", c.layout, (1, 3))
            st = status(d.endpoint)
            assert st["model"]["tiers"]["origin"]["up"] is True
            assert st["model"]["tiers"]["origin"]["fetches"] == 1
        finally:
            srv.stop()
    assert d.stop() == 0
