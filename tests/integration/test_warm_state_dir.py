"""A shared warm-restart state directory: a start never deletes another daemon's state.

Two real ``k3d start`` daemons, each on its own checkpoint, share one ``--state-dir``
and save their state at SIGTERM.  Nine more state files (newer than theirs: a count
bound keeping the newest would drop the two) name checkpoints that still exist, and
three name checkpoints since deleted.  A third daemon's start then deletes exactly
the three whose checkpoints are gone.
"""

from __future__ import annotations

import os
import shutil
import time

import k3client
from k3d.cache.warm import save
from k3d.demo.synthetic import write_checkpoint


def small(path, seed):
    return write_checkpoint(str(path), layers=2, experts=4, hidden=128, inter=64, seed=seed)


def states(d) -> set[str]:
    return {n for n in os.listdir(d) if n.startswith("state-") and n.endswith(".json")}


def test_a_start_deletes_only_the_state_of_checkpoints_that_are_gone(tmp_path, start_daemon):
    state_dir = tmp_path / "state"
    a, b, c = (small(tmp_path / n, seed) for n, seed in (("a", 1), ("b", 2), ("c", 3)))
    saved = {}
    for ckpt in (a, b):
        before = states(state_dir) if state_dir.exists() else set()
        d = start_daemon(ckpt, "--state-dir", state_dir)
        with k3client.connect(d.endpoint, timeout=10) as cl:
            cl.fetch(0, [0, 1])
        assert d.stop() == 0
        (saved[ckpt],) = states(state_dir) - before       # its own file, written at shutdown
    later = time.time() + 60
    alive, dead = [], []
    for i in range(12):
        ckpt = small(tmp_path / f"other-{i}", 10 + i)
        p = state_dir / f"state-other{i:02d}.json"
        save(str(p), f"print-{i}", "cycle", [[0, 0]], {}, source=ckpt)
        os.utime(p, (later + i, later + i))               # newer than a's and b's
        if i % 4 == 3:
            shutil.rmtree(ckpt)
            dead.append(p.name)
        else:
            alive.append(p.name)
    assert len(alive) == 9
    d = start_daemon(c, "--state-dir", state_dir)
    left = states(state_dir)
    assert {saved[a], saved[b]} <= left, d.log()          # the other daemons' state stays
    assert set(alive) <= left and not set(dead) & left, (sorted(left), d.log())
    log = d.log()
    assert all(f"removed {state_dir / n} (its checkpoint is gone)" in log for n in dead), log
    assert d.stop() == 0
    assert {saved[a], saved[b]} <= states(state_dir)
