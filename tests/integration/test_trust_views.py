"""Views keep their bytes whatever the client does: the issue's two reproductions, with real processes.

- **A request given up on.**  Client B (its own process) fetches a cold expert from
  a slow HTTP origin with ``timeout=0.5``, catches the ``Timeout``, then fetches two
  resident experts.  Client A then misses experts in a 4-slot arena.  B's views
  must keep their bytes (before the fix B answered those fetches itself, in a
  window the daemon thought shut, and 12 of 12 tensors were rewritten).
- **A long hold.**  B answers two fetches itself and holds the views for three
  leases (one layer of a long CPU prefill) while A evicts all the time.  B's
  views keep their bytes (before: rewritten once the lease had passed), and A's
  misses keep completing: B's lease thread reports what it read, so only those
  slots are held back.

B checks every tensor of its views against the checkpoint (``safetensors``' own
reading) after the hold and prints how many differ.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

import k3client
from faulty_http import Fault, FaultyServer
from helpers import TESTS
from k3d.demo.synthetic import write_checkpoint

B = r"""
import json, sys, time
import numpy as np, k3client
sys.path.insert(0, sys.argv[3])
from helpers import reference
endpoint, ckpt, mode = sys.argv[1], sys.argv[2], sys.argv[4]
ref = reference(ckpt)
with k3client.connect(endpoint, name="b", timeout=0.5 if mode == "timeout" else 60) as c:
    c.fetch(0, [0, 1])                      # read, then unpinned at the next token
    c.begin_token()
    print(json.dumps({"ready": 1}), flush=True)
    sys.stdin.readline()                    # the test arms the slow origin / A waits
    if mode == "timeout":
        try:
            c.fetch(1, [3])                 # cold, from a stalled origin
            raise SystemExit("the cold fetch did not time out")
        except k3client.Timeout:
            pass
    views = c.fetch(0, [0, 1])              # resident
    arrays = [(ex, s.name, ex.array(s.name)) for ex in views for s in c.layout]
    print(json.dumps({"holding": len(arrays)}), flush=True)
    sys.stdin.readline()                    # A evicts meanwhile; the test says when to look
    wrong = sum(not np.array_equal(a, ref.expert(ex.layer, ex.expert, name)) for ex, name, a in arrays)
    print(json.dumps({"wrong": wrong, "tensors": len(arrays)}), flush=True)
"""


def _start_b(endpoint, ckpt, mode):
    b = subprocess.Popen([sys.executable, "-c", B, endpoint, str(ckpt), TESTS, mode],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return b


def _line(b) -> dict:
    line = b.stdout.readline()
    assert line, b.stderr.read()
    return json.loads(line)


def _tell(b) -> None:
    b.stdin.write("go\n")
    b.stdin.flush()


def _evict(a, rounds: int, first: int = 0) -> int:
    """A's misses, one key a token, over the 32 keys of layers 2 and 3 from ``first``: returns
    how many completed."""
    done = 0
    for i in range(first, first + rounds):
        a.begin_token()
        try:
            a.fetch(2 + i % 2, [i % 16])
            done += 1
        except (k3client.CacheFull, k3client.K3Error) as e:
            assert "cache full" in str(e) or "slots" in str(e), e
    return done


@pytest.fixture
def origin(tmp_path):
    ck = write_checkpoint(str(tmp_path / "origin" / "ck"), layers=4, experts=16, shards=2, seed=3)
    srv = FaultyServer(str(tmp_path / "origin")).start()
    yield srv, ck
    srv.stop()


def test_views_survive_a_timed_out_request_and_other_clients_misses(origin, start_daemon):
    srv, ck = origin
    d = start_daemon(srv.url + "ck/", "--slots", "4", "--predict", "client", "--http-timeout", "10")
    b = _start_b(d.endpoint, ck, "timeout")
    try:
        assert _line(b) == {"ready": 1}
        srv.add(Fault("stall", times=None, stall_s=2.0))    # every read from now on takes 2 s
        _tell(b)
        assert _line(b)["holding"] > 0
        with k3client.connect(d.endpoint, name="a", timeout=30) as a:
            _evict(a, 6)                   # misses in the 4-slot arena, while B holds
        _tell(b)
        out = _line(b)
        assert out["wrong"] == 0, f"{out['wrong']} of {out['tensors']} tensors rewritten under B's views"
    finally:
        b.kill()
        b.wait(10)
        srv.clear()


def test_views_held_for_longer_than_the_lease_keep_their_bytes(checkpoint, start_daemon):
    d = start_daemon(checkpoint, "--slots", "4", "--lease", "1", "--predict", "client", "--policy", "lru")
    b = _start_b(d.endpoint, checkpoint, "hold")
    try:
        assert _line(b) == {"ready": 1}
        _tell(b)
        assert _line(b)["holding"] > 0
        with k3client.connect(d.endpoint, name="a", timeout=30) as a:
            before = a.status()["stats"]
            t_end = time.monotonic() + 3.0          # three leases
            done = 0
            while time.monotonic() < t_end:
                done += _evict(a, 2, first=done)
            after = a.status()["stats"]
        _tell(b)
        out = _line(b)
        assert out["wrong"] == 0, f"{out['wrong']} of {out['tensors']} tensors rewritten under B's views"
        assert after["client_hits"] >= 2            # B answered those itself; its lease thread told
        assert done >= 4 and after["evictions"] > before["evictions"], (done, after)
    finally:
        b.kill()
        b.wait(10)
