"""Restarts under a running client: kill -9 / restart cycles, SIGTERM restarts, no return.

The client runs in a thread of the test process with a real ``k3d start``
subprocess on a fixed endpoint; the test kills and restarts it while the
client keeps fetching.  Every fetched tensor is compared with
``safetensors.safe_open``; after each restart the client must be serving
again within 5 s of the new daemon's ``ready`` line.  The arena is a memfd, so
no k3d name appears in /dev/shm, and the client must not keep old arenas mapped.

The seed is printed (``K3D_TEST_SEED`` replays it).  ``bench/soak_restart.py``
runs the same loop for 100 cycles; test_faults re-issues a fetch parked on a
slow read across a kill -9.
"""

import functools
import os
import random
import signal
import tempfile
import threading
import time

import numpy as np
import pytest
import zmq

import k3client
from conftest import SCRATCH
from helpers import k3d_shm, poll_for, reference


def arena_mappings() -> int:
    """Distinct k3d arena memfds this process still maps."""
    with open("/proc/self/maps") as f:
        return len({line.split()[4] for line in f if "k3d-arena" in line})


def fresh_endpoint():
    return f"ipc://{tempfile.mkdtemp(prefix='k3d-r-', dir=SCRATCH)}/k.sock"


class Survivor(threading.Thread):
    """A client that fetches and verifies until told to stop."""

    def __init__(self, endpoint, ckpt, seed, reconnect_timeout=20.0):
        super().__init__(daemon=True)
        self.endpoint, self.ref, self.rng = endpoint, reference(ckpt), random.Random(seed)
        self.reconnect_timeout = reconnect_timeout
        self.stop = threading.Event()
        self.ok_times: list[float] = []
        self.keys = self.wrong = self.restarts = 0
        self.error = None
        self.ready = threading.Event()

    def served_since(self, t: float) -> bool:
        """A fetch completed after ``t``; raises the client's error if it has one."""
        assert self.error is None, self.error
        return bool(self.ok_times) and self.ok_times[-1] > t

    def run(self):
        try:
            with k3client.connect(self.endpoint, name="survivor", reconnect_timeout=self.reconnect_timeout) as c:
                self.ready.set()
                while not self.stop.is_set():
                    c.begin_token()
                    layer = self.rng.randrange(4)
                    exs = c.fetch(layer, self.rng.sample(range(16), 3),
                                  predicted=[((layer + 1) % 4, self.rng.randrange(16))])
                    for ex in exs:
                        self.keys += 1
                        for spec in c.layout:
                            want = self.ref.expert(ex.layer, ex.expert, spec.name)
                            self.wrong += not np.array_equal(ex.array(spec.name), want)
                    del exs
                    self.ok_times.append(time.monotonic())
                self.restarts = c.restarts
        except BaseException as e:   # reported by the test
            self.error = e
            self.ready.set()


def test_kill9_restart_cycles_client_survives(checkpoint, start_daemon):
    seed = int(os.environ.get("K3D_TEST_SEED", random.randrange(1 << 30)))
    print(f"seed {seed} (rerun with K3D_TEST_SEED={seed})")
    rng = random.Random(seed)
    cycles = 12
    endpoint = fresh_endpoint()
    shm_before = k3d_shm()
    d = start_daemon(checkpoint, "--slots", "24", endpoint=endpoint)
    w = Survivor(endpoint, checkpoint, seed)
    w.start()
    assert w.ready.wait(10) and w.error is None, w.error
    resume = []
    for _ in range(cycles):
        time.sleep(rng.uniform(0.05, 0.4))      # kill at a random point of the fetch loop
        os.kill(d.pid, signal.SIGKILL)
        d.proc.wait(10)
        d = start_daemon(checkpoint, "--slots", "24", endpoint=endpoint)
        t_ready = time.monotonic()
        # a bound that catches a client that never resumes, not a speed target (a loaded
        # machine once took over 5 s here)
        poll_for(functools.partial(w.served_since, t_ready), 20, "the client to be served within 20 s of the restart")
        resume.append(w.ok_times[-1] - t_ready)
    w.stop.set()
    w.join(30)
    assert w.error is None, w.error
    print(f"{cycles} restarts: resume max {max(resume):.3f}s mean {sum(resume) / len(resume):.3f}s; "
          f"{w.keys} keys verified")
    assert w.wrong == 0
    assert w.restarts == cycles
    assert max(resume) < 20
    assert k3d_shm() == shm_before
    assert arena_mappings() == 0          # the client closed: no old arena stays mapped
    assert d.stop() == 0


def test_old_experts_refuse_after_restart(checkpoint, start_daemon):
    endpoint = fresh_endpoint()
    d = start_daemon(checkpoint, "--slots", "16", endpoint=endpoint)
    with k3client.connect(endpoint, name="stale", reconnect_timeout=20) as c:
        old = c.fetch(0, [1, 2])
        view = old[0].array("w1.weight_packed").copy()
        gen = c.gen
        assert d.stop() == 0                                    # graceful restart
        d = start_daemon(checkpoint, "--slots", "16", endpoint=endpoint)
        new = c.fetch(1, [3])                                   # re-attaches transparently
        assert c.gen != gen and c.restarts == 1
        for ex in old:
            with pytest.raises(k3client.DaemonRestarted, match="restarted"):
                ex.array("w1.weight_packed")
            with pytest.raises(k3client.DaemonRestarted):
                ex.memory()
        again = c.fetch(0, [1])
        assert np.array_equal(again[0].array("w1.weight_packed"), view)
        assert new[0].array("w2.weight_scale").shape
        assert [x["name"] for x in c.status()["clients"]] == ["stale"]
    assert d.stop() == 0


def test_no_return_raises_daemon_not_running(checkpoint, start_daemon):
    endpoint = fresh_endpoint()
    d = start_daemon(checkpoint, "--slots", "16", endpoint=endpoint)
    with k3client.connect(endpoint, name="orphan", reconnect_timeout=1.5) as c:
        ex = c.fetch(0, [1])[0]
        os.kill(d.pid, signal.SIGKILL)
        d.proc.wait(10)
        t0 = time.monotonic()
        with pytest.raises(k3client.DaemonNotRunning, match="did not come back within 1.5s"):
            c.fetch(0, [2])
        assert time.monotonic() - t0 < 6
        with pytest.raises(k3client.DaemonRestarted):
            ex.array("w1.weight_packed")
        # The daemon comes back later: the next call attaches again.
        d = start_daemon(checkpoint, "--slots", "16", endpoint=endpoint)
        assert c.fetch(0, [2])[0].array("w1.weight_scale").size
    assert d.stop() == 0


def test_reconnect_timeout_zero_raises_daemon_restarted(checkpoint, start_daemon):
    endpoint = fresh_endpoint()
    d = start_daemon(checkpoint, "--slots", "16", endpoint=endpoint)
    with k3client.connect(endpoint, name="strict", reconnect_timeout=0) as c:
        c.fetch(0, [1])
        assert d.stop() == 0
        d = start_daemon(checkpoint, "--slots", "16", endpoint=endpoint)
        with pytest.raises(k3client.DaemonRestarted, match="reconnect"):
            c.fetch(0, [2])
    assert d.stop() == 0


def test_daemon_back_with_another_layout_is_an_error(checkpoint, start_daemon, tmp_path):
    from k3d.demo.synthetic import write_checkpoint
    other = write_checkpoint(str(tmp_path / "other"), layers=2, experts=4, hidden=256, inter=128, seed=3)
    endpoint = fresh_endpoint()
    d = start_daemon(checkpoint, "--slots", "8", endpoint=endpoint)
    with k3client.connect(endpoint, name="layout", reconnect_timeout=10) as c:
        c.fetch(0, [1])
        assert d.stop() == 0
        d = start_daemon(other, "--slots", "8", endpoint=endpoint)
        with pytest.raises(k3client.DaemonRestarted, match="different expert layout"):
            c.fetch(0, [1])
    assert d.stop() == 0


def test_heartbeats_follow_the_lease_of_the_daemon_that_came_back(checkpoint, start_daemon):
    """A daemon restarted with a shorter lease: the client's lease thread beats at the new
    daemon's pace, so an idle but live client keeps its pins."""
    ep = fresh_endpoint()
    d1 = start_daemon(checkpoint, "--slots", "8", "--lease", "10", endpoint=ep)
    with k3client.connect(ep, name="idle") as c:
        d1.stop(signal.SIGKILL)
        d2 = start_daemon(checkpoint, "--slots", "8", "--lease", "0.8", endpoint=ep)
        c.fetch(0, [1])                      # re-attaches to d2, pins one slot
        time.sleep(2.5)                      # three leases of silence but for the heartbeats
        me = next(x for x in c.status()["clients"] if x["name"] == "idle")
        assert me["pins"] == 1, me
        assert "silent for" not in d2.log(), d2.log()
    assert d2.stop() == 0


def test_lease_thread_outlives_a_full_send_queue():
    """While no daemon listens, beats are skipped, not queued: a full queue (here after one
    message) must not end the lease thread, or the client would never heartbeat again."""
    from k3client.lease import heartbeat as _heartbeat

    class Idle:
        _lease, lease_s = (1, 1), 0.8       # beats every 0.2 s

        def _lease_sync(self):              # no hit path: nothing to report
            pass

    ctx = zmq.Context()
    ctx.setsockopt(zmq.SNDHWM, 1)
    client, stop, wake = Idle(), threading.Event(), threading.Event()
    t = threading.Thread(target=_heartbeat, args=(lambda: client, ctx, fresh_endpoint(), 0.2, stop, wake),
                         daemon=True)
    t.start()
    time.sleep(1.2)                          # ~6 beats with nobody listening
    try:
        assert t.is_alive()
    finally:
        stop.set()
        wake.set()
        t.join(2)
        ctx.term()


def test_posted_begin_token_is_settled_before_a_view(checkpoint, start_daemon):
    """``begin_token(wait=False)`` returns at once; the next fetch reads its reply first (the
    epoch has begun before any view, hit or not), and a daemon restarted while it is
    outstanding is re-attached, the epoch begun on the new daemon."""
    endpoint = fresh_endpoint()
    d = start_daemon(checkpoint, "--slots", "24", endpoint=endpoint)
    ref = reference(checkpoint)

    def same(ex, c):
        return all(np.array_equal(ex.array(s.name), ref.expert(ex.layer, ex.expert, s.name)) for s in c.layout)

    with k3client.connect(endpoint) as c:
        for _ in range(3):                       # a miss, then hits answered in the client
            assert c.begin_token(wait=False) is None and c._pending is not None
            (ex,) = c.fetch(1, [3])
            assert c._pending is None and same(ex, c)
            del ex
        assert c.begin_token(wait=False) is None
        os.kill(d.pid, signal.SIGKILL)
        d.proc.wait(10)
        start_daemon(checkpoint, "--slots", "24", endpoint=endpoint)
        (ex,) = c.fetch(1, [4])
        assert c.restarts == 1 and c._pending is None and same(ex, c)


def test_daemon_back_with_a_fine_tune_of_the_same_shapes_is_an_error(checkpoint, start_daemon, tmp_path):
    """The checkpoint is replaced in place by another of the same shapes (a fine-tune) and the
    daemon restarted on it: a client that verified the first must not go on computing with
    the second's experts after its transparent re-attach.  Refused in one line, or never served."""
    import shutil

    from k3d.demo.synthetic import write_checkpoint
    served = shutil.copytree(checkpoint, str(tmp_path / "served"))
    tuned = write_checkpoint(str(tmp_path / "tuned"), layers=4, experts=16, shards=2, seed=8)
    tuned_ref = reference(tuned)
    endpoint = fresh_endpoint()
    d = start_daemon(served, "--slots", "16", endpoint=endpoint)
    with k3client.connect(endpoint, name="verified", reconnect_timeout=20) as c:
        c.verify(served)
        name = c.layout[0].name
        before = c.fetch(0, [1])[0].array(name).copy()
        assert d.stop() == 0
        for f in os.listdir(tuned):
            shutil.copyfile(os.path.join(tuned, f), os.path.join(served, f))
        d = start_daemon(served, "--slots", "16", endpoint=endpoint)
        try:
            got = c.fetch(0, [1])[0].array(name)
        except k3client.DaemonRestarted as e:
            assert "came back serving another checkpoint" in str(e) and "\n" not in str(e)
        else:
            assert not np.array_equal(got, tuned_ref.expert(0, 1, name)), \
                "the client re-attached to a daemon serving a fine-tune and computed with its bytes"
            assert np.array_equal(got, before)
    assert d.stop() == 0
