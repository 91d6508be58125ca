"""Faults against the real ``k3d start``: dying clients, failing reads, memory limits.

- A client killed (-9) mid-fetch, and while it waits on a cold miss (reads
  slowed down), loses its pins; a client waiting on the same key still gets
  it; the daemon keeps serving and logs no traceback.
- A shard whose reads fail past an offset (an I/O error, injected: a shard
  changed under the daemon is a different fault, test_source_changed): a batch
  fetch over it fails with a clear ReadFailed, the keys read before the bad
  region stay usable, nothing stays loading or pinned, and once the disk reads
  again the next fetch retries and serves correct bytes.
- An arena that does not fit (available memory; a memory cgroup limit, as
  systemd's MemoryMax sets) is a one-line error at start, never a SIGBUS or
  an OOM kill later.

``SLOW_DAEMON`` runs the real CLI with every source read delayed (the only
thing a local disk cannot produce on demand); test_restart uses it too.
``FAILING_DAEMON`` makes reads of one file past an offset fail with EIO while a
flag file exists (the other thing a disk will not do on demand).
"""

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

import k3client
from conftest import spawn_daemon
from helpers import poll_for, reference, verify

SLOW_DAEMON = r"""
import sys, time
from k3d import sources
delay = float(sys.argv.pop(1))
for cls in [sources.Source, *sources.Source.__subclasses__()]:
    if "read" in cls.__dict__:
        def slow(self, extents, slot, _orig=cls.__dict__["read"]):
            time.sleep(delay)
            return _orig(self, extents, slot)
        cls.read = slow
from k3d.commands.cli import main
sys.exit(main(sys.argv[1:]))
"""


FAILING_DAEMON = r"""
import errno, os, sys
from k3d.sources import base
flag, path, cut = sys.argv.pop(1), sys.argv.pop(1), int(sys.argv.pop(1))
real = base.read_fully
def failing(fd, buffers, offset, what):
    end = offset + sum(len(b) for b in buffers)
    if end > cut and os.path.exists(flag) and os.readlink(f"/proc/self/fd/{fd}") == path:
        raise OSError(errno.EIO, f"{what}: Input/output error at offset {max(offset, cut)}")
    return real(fd, buffers, offset, what)
base.read_fully = failing
from k3d.commands.cli import main
sys.exit(main(sys.argv[1:]))
"""


def spawn_slow(source, delay, *args, endpoint=None, timeout=60):
    """``k3d start`` with every read delayed by ``delay`` seconds; a conftest.Daemon."""
    return spawn_daemon(source, *args, endpoint=endpoint, timeout=timeout,
                        launcher=[sys.executable, "-c", SLOW_DAEMON, str(delay)])


@pytest.fixture
def slow_daemon(start_daemon):
    return lambda source, delay, *args, **kw: start_daemon(
        source, *args, launcher=[sys.executable, "-c", SLOW_DAEMON, str(delay)], **kw)


CLIENT = r"""
import sys, k3client
endpoint, mode = sys.argv[1], sys.argv[2]
c = k3client.connect(endpoint, name=mode)
print("attached", flush=True)
if mode == "cold":
    c.fetch(3, [10, 11, 12])        # blocks on slow reads until killed
else:
    i = 0
    while True:                     # hot loop: fetch, read, next token
        c.begin_token()
        for ex in c.fetch(i % 2, [i % 4, 4 + i % 4]):
            ex.array("w1.weight_packed").sum()
        i += 1
"""


def client_proc(endpoint, mode):
    p = subprocess.Popen([sys.executable, "-c", CLIENT, endpoint, mode], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "attached"
    return p


# -- dying clients -----------------------------------------------------------------
def test_client_killed_mid_fetch_loses_pins(checkpoint, start_daemon):
    seed = int(os.environ.get("K3D_TEST_SEED", random.randrange(1 << 30)))
    print(f"seed {seed} (rerun with K3D_TEST_SEED={seed})")
    rng = random.Random(seed)
    d = start_daemon(checkpoint, "--slots", "24")
    ref = reference(checkpoint)
    with k3client.connect(d.endpoint, name="watcher") as w:
        for _ in range(4):
            p = client_proc(d.endpoint, "hot")
            time.sleep(rng.uniform(0.05, 0.5))           # somewhere inside its fetch loop
            p.kill()
            p.wait()
            poll_for(lambda: [c["name"] for c in w.status()["clients"]] == ["watcher"], 3, "reaping")
            w.begin_token()                              # drop the watcher's own pins
            st = w.status()
            assert st["arena"]["pinned"] == 0 and st["arena"]["loading"] == 0
            verify(w, w.fetch(0, [0, 1, 2, 3]), ref)
    assert d.stop() == 0
    assert "Traceback" not in d.log()


def test_client_killed_while_waiting_on_cold_miss(checkpoint, slow_daemon):
    d = slow_daemon(checkpoint, 1.5, "--slots", "16", "--readers", "2")
    ref = reference(checkpoint)
    with k3client.connect(d.endpoint, name="watcher") as w:
        p = client_proc(d.endpoint, "cold")
        poll_for(lambda: w.status()["arena"]["loading"] == 3, 3, "the cold fetch to start")
        st = {c["name"]: c for c in w.status()["clients"]}
        assert st["cold"]["pins"] == 3
        # a second client waits on one of the same keys (hit + waited)
        t0 = time.monotonic()
        p.kill()
        p.wait()
        exs = w.fetch(3, [11])                           # waits for the dead client's read
        verify(w, exs, ref)
        assert time.monotonic() - t0 < 5
        poll_for(lambda: [c["name"] for c in w.status()["clients"]] == ["watcher"], 3, "reaping")
        poll_for(lambda: w.status()["arena"]["loading"] == 0, 6, "reads to finish")
        st = w.status()
        assert st["arena"]["pinned"] == 1                 # only the watcher's own pin
        assert st["stats"]["waited"] >= 1 and st["stats"]["errors"] == 0
        w.begin_token()
        before = w.status()["stats"]["misses"]
        verify(w, w.fetch(3, [10, 12]), ref)              # the dead client's reads were kept
        assert w.status()["stats"]["misses"] == before
    assert d.stop() == 0
    assert "Traceback" not in d.log()


def test_fetch_in_flight_during_kill9_is_reissued_to_the_new_daemon(checkpoint, slow_daemon):
    d = slow_daemon(checkpoint, 1.0, "--slots", "16")
    ref = reference(checkpoint)
    with k3client.connect(d.endpoint, name="inflight", reconnect_timeout=20) as c:
        gen = c.gen
        def kill_when_loading():
            with k3client.connect(d.endpoint, name="watcher") as w:   # the fetch is parked on its 1 s reads
                poll_for(lambda: w.status()["arena"]["loading"] == 2, 5, "the fetch's reads to start")
            os.kill(d.pid, signal.SIGKILL)
            d.proc.wait(10)
            holder.append(spawn_slow(checkpoint, 0.0, "--slots", "16", endpoint=d.endpoint))

        holder = []
        t = threading.Thread(target=kill_when_loading)
        t.start()
        t0 = time.monotonic()
        exs = c.fetch(2, [3, 4])                          # sent to the old daemon, answered by the new
        t.join()
        assert c.gen != gen and c.restarts == 1 and exs[0].gen == c.gen
        verify(c, exs, ref)
        assert time.monotonic() - t0 < 15
    assert holder[0].stop() == 0


# -- failing reads -------------------------------------------------------------------
def test_read_failing_mid_batch(checkpoint, start_daemon, tmp_path):
    shard = os.path.realpath(os.path.join(checkpoint, "model-00002-of-00002.safetensors"))
    ref = reference(checkpoint)
    with open(shard, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))

    def span(e):
        offs = [header[k]["data_offsets"] for k in header if k.startswith(f"model.layers.3.mlp.experts.{e}.")]
        return 8 + n + min(o[0] for o in offs), 8 + n + max(o[1] for o in offs)

    cut = span(9)[0] + 100                                # expert 9 of layer 3 cannot be read whole
    ok = [e for e in range(16) if span(e)[1] <= cut]
    bad = [e for e in range(16) if span(e)[1] > cut]
    assert ok and bad
    flag = tmp_path / "disk-fails"
    flag.write_text("")
    d = start_daemon(checkpoint, "--slots", "32",
                     launcher=[sys.executable, "-c", FAILING_DAEMON, str(flag), shard, str(cut)])
    with k3client.connect(d.endpoint, name="victim") as c:
        with pytest.raises(k3client.ReadFailed, match=r"Input/output error.*the next fetch retries"):
            c.fetch(3, list(range(16)))
        poll_for(lambda: c.status()["arena"]["loading"] == 0, 5, "the batch to settle")
        st = c.status()
        assert st["stats"]["errors"] == len(bad)
        assert st["arena"]["used"] == len(ok)             # failed slots went back to free
        c.begin_token()
        assert c.status()["arena"]["pinned"] == 0
        misses = c.status()["stats"]["misses"]
        verify(c, c.fetch(3, ok[:4]), ref)                # read whole: still good, hits
        assert c.status()["stats"]["misses"] == misses
        with pytest.raises(k3client.ReadFailed):
            c.fetch(3, [bad[0]])                          # retried, fails again
        flag.unlink()                                     # the disk reads again
        c.begin_token()
        verify(c, c.fetch(3, bad[:4]), ref)
        verify(c, c.fetch(1, [0, 15]), ref)               # the other shard never noticed
    assert d.stop() == 0
    assert "Traceback" not in d.log()


# -- memory limits -----------------------------------------------------------------------
def test_arena_over_memory_cgroup_limit_is_a_clear_start_error(checkpoint, tmp_path):
    """The arena is charged to the daemon's memory cgroup (systemd MemoryMax=)."""
    cg = f"/sys/fs/cgroup/memory/k3dtest-{os.getpid()}"
    v2 = f"/sys/fs/cgroup/k3dtest-{os.getpid()}"
    limit_file = None
    for path, name in ((cg, "memory.limit_in_bytes"), (v2, "memory.max")):
        try:
            os.mkdir(path)
        except OSError:
            continue
        if os.path.exists(os.path.join(path, name)):
            limit_file, root = name, path
            break
        os.rmdir(path)
    if limit_file is None:
        pytest.skip("cannot create a memory cgroup here (needs root and a writable cgroupfs)")
    try:
        with open(os.path.join(root, limit_file), "w") as f:
            f.write(str(96 * 2**20))
        cmd = (f"echo $$ > {root}/cgroup.procs && exec {sys.executable} -m k3d start --source {checkpoint} "
               f"--endpoint ipc://{tmp_path}/k.sock --arena 256MiB")
        r = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=60)
        assert r.returncode == 1, (r.returncode, r.stderr)   # not 137: no OOM kill
        err = [l for l in r.stderr.splitlines() if "error" in l]
        assert len(err) == 1 and "does not fit the memory cgroup" in err[0] and "MemoryMax" in err[0]
        assert not os.path.exists(f"{tmp_path}/k.sock")
    finally:
        for _ in range(50):
            try:
                os.rmdir(root)
                break
            except OSError:
                time.sleep(0.1)


def test_one_clients_big_cold_fetch_does_not_queue_everyone_behind_it(checkpoint, slow_daemon):
    """Fair share of the readers: B's miss waits behind a few of A's parts, not all 16."""
    d = slow_daemon(checkpoint, 0.2, "--slots", "32", "--readers", "2")
    ref = reference(checkpoint)
    with k3client.connect(d.endpoint, name="big") as a, k3client.connect(d.endpoint, name="small") as b:
        result = {}

        def big():
            t0 = time.monotonic()
            result["a"] = a.fetch(2, list(range(16)))
            result["a_s"] = time.monotonic() - t0

        t = threading.Thread(target=big)
        t.start()
        poll_for(lambda: b.status()["arena"]["loading"] == 16, 3, "the big fetch to start")
        t0 = time.monotonic()
        exs = b.fetch(3, [7])
        b_s = time.monotonic() - t0
        t.join(30)
        verify(b, exs, ref)
        verify(a, result["a"], ref)
        # unfair FIFO: 16 parts x 0.2 s / 2 readers ahead of B = 1.6 s; fair: ~0.4 s
        assert b_s < 1.1, f"small fetch took {b_s:.2f}s behind a big one ({result['a_s']:.2f}s)"
        assert result["a_s"] < 3.0
    assert d.stop() == 0
