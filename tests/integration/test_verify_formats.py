"""``Client.verify`` against a real ``k3d start`` serving a pack, a GGUF file, an HTTP origin.

The pack is made from a safetensors checkpoint by ``k3d pack``: verify accepts the
pack and the directory it was made from, and refuses a checkpoint of the same
layout with other values in one line.  A GGUF file written by the reference writer:
verify accepts it, refuses another seed's.  An HTTP origin down at a restart: the digest
comes from the state directory, or verify says in one line why it cannot compare.
"""

from __future__ import annotations

import os

import pytest

import k3client
from faulty_http import FaultyServer
from helpers import k3d, served_digest
from k3d.demo.synthetic import write_checkpoint, write_synthetic_gguf


def test_pack_daemon_accepts_the_pack_and_its_source_refuses_other_values(tmp_path, start_daemon):
    src = write_checkpoint(str(tmp_path / "ck"), layers=2, experts=4, shards=2, seed=7)
    other = write_checkpoint(str(tmp_path / "other"), layers=2, experts=4, shards=2, seed=8)
    pack = str(tmp_path / "ck.k3pack")
    r = k3d("pack", src, pack)
    assert r.returncode == 0, r.stderr
    d = start_daemon(pack, "--arena", "8MiB")
    with k3client.connect(d.endpoint, name="v") as c:
        want = served_digest(c)["hex"]
        assert c.verify(pack)["hex"] == want
        assert c.verify(src)["hex"] == want
        with pytest.raises(k3client.Mismatch) as e:
            c.verify(other)
    msg = str(e.value)
    assert "\n" not in msg and pack in msg and other in msg and "holds other bytes" in msg


def test_gguf_daemon_accepts_its_file_refuses_another(tmp_path, start_daemon):
    pytest.importorskip("gguf")
    a = write_synthetic_gguf(str(tmp_path / "a.gguf"), layers=2, experts=4, seed=3)
    b = write_synthetic_gguf(str(tmp_path / "b.gguf"), layers=2, experts=4, seed=4)
    d = start_daemon(a, "--arena", "8MiB")
    with k3client.connect(d.endpoint, name="v") as c:
        c.verify(a)
        with pytest.raises(k3client.Mismatch, match="holds other bytes"):
            c.verify(b)


def test_offline_restart_takes_the_digest_from_the_state_dir_or_says_why_not(tmp_path, start_daemon):
    """An HTTP origin down at a restart: with the state directory of the first start the digest
    is the same (keyed by URL and ETag) and verify passes; with a fresh one it cannot be
    computed, the daemon still serves, and verify refuses in one line saying why."""
    ck = write_checkpoint(str(tmp_path / "origin" / "ck"), layers=2, experts=4, shards=2, seed=5)
    srv = FaultyServer(str(tmp_path / "origin")).start()
    args = ("--arena", "4MiB", "--disk-cache", tmp_path / "cache", "--http-retries", "1", "--http-timeout", "2")
    env = dict(os.environ, K3D_STATE_DIR=str(tmp_path / "state"))
    try:
        d = start_daemon(srv.url + "ck/", *args, env=env)
        with k3client.connect(d.endpoint, name="online") as c:
            want = c.verify(ck)["hex"]
        assert d.stop() == 0
    finally:
        srv.stop()
    d = start_daemon(srv.url + "ck/", *args, env=env, endpoint=d.endpoint)
    with k3client.connect(d.endpoint, name="offline") as c:
        assert c.model["digest"]["cached"] and c.verify(ck)["hex"] == want
    assert d.stop() == 0
    fresh = dict(env, K3D_STATE_DIR=str(tmp_path / "fresh"))
    d = start_daemon(srv.url + "ck/", *args, env=fresh, endpoint=d.endpoint)
    with k3client.connect(d.endpoint, name="offline") as c:
        with pytest.raises(k3client.Mismatch, match="^cannot verify") as e:
            c.verify(ck)                         # (waits while the digest is tried after ready)
    assert "\n" not in str(e.value)
    assert "cannot compute the content digest" in d.log()
