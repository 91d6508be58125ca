"""Integration: the real ``k3d start`` and ``k3ctl`` as subprocesses."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import k3client
from helpers import k3ctl, k3d, k3d_shm, poll_for


def test_ready_status_sigterm_leaves_nothing(checkpoint, start_daemon):
    before = k3d_shm()
    d = start_daemon(checkpoint, "--arena", "4MiB")
    assert "reserving the arena" in d.log()
    r = k3ctl("status", "--endpoint", d.endpoint, "--json")
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert st["pid"] == d.pid and st["arena"]["slots"] == 4 * 2**20 // st["arena"]["slot_bytes"]
    human = k3ctl("status", "--endpoint", d.endpoint)
    assert human.returncode == 0 and "hit rate" in human.stdout
    assert d.stop(signal.SIGTERM) == 0
    assert k3d_shm() - before == set()
    sock = d.endpoint[len("ipc://"):]
    assert not os.path.exists(sock) and not os.path.exists(sock + ".arena")
    r = k3ctl("status", "--endpoint", d.endpoint)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "not running" in r.stderr


def test_sigint_also_exits_zero(checkpoint, start_daemon):
    d = start_daemon(checkpoint, "--arena", "4MiB")
    assert d.stop(signal.SIGINT) == 0


def test_kill9_leaves_nothing_and_next_start_takes_over(checkpoint, start_daemon):
    """The arena is a memfd: nothing is ever in /dev/shm; the next start removes stale sockets."""
    before = k3d_shm()
    d = start_daemon(checkpoint, "--arena", "4MiB")
    with k3client.connect(d.endpoint, name="x") as c:
        c.fetch(0, [1])
    d.stop(signal.SIGKILL)
    assert k3d_shm() - before == set()
    d2 = start_daemon(checkpoint, "--arena", "4MiB", endpoint=d.endpoint)
    assert "stale sockets" in d2.log()
    with k3client.connect(d.endpoint, name="y") as c:
        assert c.fetch(0, [1])[0].expert == 1
    assert d2.stop() == 0


def test_second_daemon_on_same_endpoint_is_refused(checkpoint, start_daemon):
    d = start_daemon(checkpoint, "--arena", "4MiB")
    r = k3d("start", "--source", checkpoint, "--endpoint", d.endpoint, "--arena", "4MiB")
    assert r.returncode == 1 and "another k3d is starting or serving at" in r.stderr, r.stderr
    assert k3ctl("status", "--endpoint", d.endpoint).returncode == 0


def _first_progress(d, timeout=30):
    def started():
        assert d.proc.poll() is None, d.log()
        return "reserving the arena" in d.log() or "collapsing the arena" in d.log()
    poll_for(started, timeout, lambda: f"the arena's first progress line:\n{d.log()}")


def test_second_daemon_refused_while_the_first_is_still_starting(checkpoint, start_daemon):
    """The first holds the endpoint from before its arena is built: a second start (whose
    sockets would otherwise replace the first's) is refused, and the first then serves."""
    first = start_daemon(checkpoint, "--arena", "3GiB", wait_ready=False)
    _first_progress(first)
    r = k3d("start", "--source", checkpoint, "--endpoint", first.endpoint, "--arena", "4MiB")
    assert r.returncode == 1 and "another k3d is starting or serving at" in r.stderr, r.stderr
    poll_for(first.ready, 60, lambda: f"the first daemon's ready line:\n{first.log()}", interval=0.02)
    assert k3ctl("status", "--endpoint", first.endpoint).returncode == 0
    assert first.stop() == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stop_during_startup_exits_0(checkpoint, start_daemon, sig):
    """systemctl stop while the arena is still being reserved: a clean exit 0, no
    traceback, the endpoint free for the next start."""
    before = k3d_shm()
    d = start_daemon(checkpoint, "--arena", "3GiB", wait_ready=False)
    _first_progress(d)
    assert d.stop(sig) == 0, d.log()
    assert "Traceback" not in d.log() and "stopped during start-up" in d.log(), d.log()
    assert k3d_shm() == before
    again = start_daemon(checkpoint, "--arena", "4MiB", endpoint=d.endpoint)
    assert again.stop() == 0


@pytest.mark.parametrize("args,words", [
    (["--source", "/nonexistent/ckpt"], "checkpoint not found: /nonexistent/ckpt"),
    (["--arena", "4KiB"], "smaller than one slot"),
    (["--arena", "100TiB"], "exceeds available memory"),
    (["--arena", "lots"], "bad value 'lots' for arena"),
    (["--readers", "0"], "readers"),
    (["--pattern", "x.{layer}.{name}"], "{expert}"),
    (["--trace", "/nonexistent/dir/route.trace"], "cannot open the route trace /nonexistent/dir/route.trace"),
    (["--lease", "inf"], "--lease: bad value inf for lease_s"),
])
def test_bad_start_is_one_line(checkpoint, tmp_path, args, words):
    base = ["start", "--endpoint", f"ipc://{tmp_path}/k.sock"]
    if "--source" not in args:
        base += ["--source", checkpoint]
    r = k3d(*base, *args)
    assert r.returncode == 1
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert words in r.stderr


def test_broken_config_file(checkpoint, tmp_path):
    cfg = tmp_path / "k3d.toml"
    cfg.write_text("readers = [\n")
    r = k3d("start", "--config", str(cfg), "--source", checkpoint)
    assert r.returncode == 1 and "does not parse" in r.stderr and r.stderr.strip().count("\n") == 0


def test_config_file_is_used(checkpoint, tmp_path, start_daemon):
    cfg = tmp_path / "k3d.toml"
    cfg.write_text(f'source = "{checkpoint}"\narena = "2MiB"\nreaders = 3\n')
    d = start_daemon(None, "--config", str(cfg))
    st = json.loads(k3ctl("status", "--endpoint", d.endpoint, "--json").stdout)
    assert st["arena"]["bytes"] <= 2 * 2**20 and st["model"]["path"] == checkpoint


def test_env_endpoint_for_k3ctl(checkpoint, start_daemon):
    d = start_daemon(checkpoint, "--arena", "4MiB")
    env = dict(os.environ, K3D_ENDPOINT=d.endpoint)
    assert k3ctl("status", env=env).returncode == 0


CLIENT = """
import sys, time, k3client
c = k3client.connect(sys.argv[1], name="victim")
c.fetch(0, [0, 1, 2])
print("pinned", flush=True)
time.sleep(60)
"""


def _wait_client(endpoint, name, present, timeout):
    """Poll status until client ``name`` is (or no longer is) attached; (status, when it was seen)."""
    last = {}

    def seen():
        with k3client.connect(endpoint, name="observer") as o:
            last["st"] = st = o.status()
        if (name in [c["name"] for c in st["clients"]]) == present:
            return st, time.monotonic()

    return poll_for(seen, timeout, lambda: f"client {name} to be {'present' if present else 'gone'}: "
                                           f"{last['st']['clients']}", interval=0.05)


def test_killed_client_loses_pins_within_2s(checkpoint, start_daemon):
    d = start_daemon(checkpoint, "--arena", "4MiB")
    p = subprocess.Popen([sys.executable, "-c", CLIENT, d.endpoint], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "pinned"
    st, _ = _wait_client(d.endpoint, "victim", True, 5)
    assert [c["pins"] for c in st["clients"] if c["name"] == "victim"] == [3]
    assert st["arena"]["pinned"] == 3
    t_kill = time.monotonic()
    p.kill()
    p.wait()
    st, t_gone = _wait_client(d.endpoint, "victim", False, 5)
    assert t_gone - t_kill < 2.0
    assert st["arena"]["pinned"] == 0 and st["stats"]["clients_dead"] == 1
    assert "victim" in d.log() and "released 3 pins" in d.log()


def test_hung_client_loses_pins_after_lease(checkpoint, start_daemon):
    d = start_daemon(checkpoint, "--arena", "4MiB", "--lease", "1")
    p = subprocess.Popen([sys.executable, "-c", CLIENT, d.endpoint], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "pinned"
        p.send_signal(signal.SIGSTOP)
        st, _ = _wait_client(d.endpoint, "victim", False, 5)
        assert st["arena"]["pinned"] == 0 and "silent for" in d.log()
    finally:
        p.kill()
        p.wait()


def test_route_trace_survives_kill9(checkpoint, start_daemon, tmp_path):
    trace = tmp_path / "route.trace"
    # the client's predictions only: the daemon's own would add auto lines to those counted
    d = start_daemon(checkpoint, "--arena", "4MiB", "--trace", str(trace), "--predict", "client")
    with k3client.connect(d.endpoint, name="t") as c:
        c.fetch(2, [4, 6], predicted=[(3, 1), (3, 2)])
        c.fetch(3, [1])              # served by the prediction
        c.begin_token()              # (3, 2) was never fetched: unused
        c.fetch(2, [4])
    d.stop(signal.SIGKILL)
    lines = [l.split() for l in trace.read_text().splitlines()]
    # fetch, its predictions, fetch, begin, fetch, bye: client 1, epochs 0 then 1
    assert [l[1:3] for l in lines] == [["c=1", "t=0"]] * 4 + [["c=1", "t=1"], ["c=1", "bye"]]
    assert lines[0][3:] == ["L2", "n=2", "miss=2", "evict=0", "wait=0", "pf=0", "pfu=0", "4", "6"]
    assert lines[1][3:] == ["predict", "3:1", "3:2"]
    assert 0 < int(lines[0][0]) <= int(lines[2][0]) <= int(lines[4][0])
    assert lines[2][3:6] == ["L3", "n=1", "miss=0"] and lines[2][8:] == ["pf=1", "pfu=0", "1"]
    assert lines[3][3:] == ["begin"]
    assert lines[4][3:] == ["L2", "n=1", "miss=0", "evict=0", "wait=0", "pf=0", "pfu=1", "4"]


def test_demo_runs_and_verifies():
    # the caller's own K3D_* settings (a tight quota here) are not the demo's
    env = dict(os.environ, K3D_PIN_QUOTA="2", K3D_READERS="0")
    r = k3d("demo", "--tokens", "20", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "demo: OK" in r.stdout and "hit rate" in r.stdout and "PSS" in r.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a directory owned by another user")
def test_socket_directory_of_another_user_is_refused(checkpoint, tmp_path):
    """/tmp/k3d-UID made first by someone else (who could then move the sockets away)."""
    import pwd

    d = tmp_path / "theirs"
    d.mkdir(mode=0o777)
    os.chown(d, pwd.getpwnam("nobody").pw_uid, -1)
    r = k3d("start", "--source", checkpoint, "--endpoint", f"ipc://{d}/k.sock", "--arena", "4MiB")
    assert r.returncode == 1 and f"socket directory {d} belongs to uid" in r.stderr, r.stderr
    assert r.stderr.strip().count("\n") == 0


def test_world_writable_socket_directory_is_refused(checkpoint, tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    r = k3d("start", "--source", checkpoint, "--endpoint", f"ipc://{d}/k.sock", "--arena", "4MiB")
    assert r.returncode == 1 and "is writable by every user (mode 777)" in r.stderr, r.stderr


ABANDON = """
import gc, sys, time, k3client
c = k3client.connect(sys.argv[1], name="abandoned")
c.fetch(0, [0, 1])
del c
gc.collect()
print("dropped", flush=True)
time.sleep(60)
"""


def test_client_dropped_without_close_loses_pins_after_lease(checkpoint, start_daemon):
    """The process lives on, but the Client object is gone: its lease thread stops."""
    d = start_daemon(checkpoint, "--arena", "4MiB", "--lease", "1")
    p = subprocess.Popen([sys.executable, "-c", ABANDON, d.endpoint], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "dropped"
        st, _ = _wait_client(d.endpoint, "abandoned", False, 5)
        assert st["arena"]["pinned"] == 0 and p.poll() is None
        assert "abandoned" in d.log() and "silent for" in d.log()
    finally:
        p.kill()
        p.wait()


def test_malformed_endpoint_is_one_line_for_k3ctl_and_client():
    r = k3ctl("status", "--endpoint", "foo://x")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "cannot connect to foo://x" in r.stderr
    with pytest.raises(k3client.DaemonNotRunning, match="cannot connect to foo://x"):
        k3client.connect("foo://x")


def test_k3ctl_refuses_a_timeout_that_would_wait_for_ever():
    r = k3ctl("status", "--timeout", "-1")
    assert r.returncode == 2 and "--timeout -1: use a positive number of seconds" in r.stderr


def test_client_refuses_keys_that_are_not_integers(checkpoint, start_daemon):
    """1.5 would be served as expert 1 and "0" parsed: both are refused, in one line, before sending."""
    import numpy as np

    d = start_daemon(checkpoint, "--arena", "4MiB")
    bad = [((0, [1.5]), "expert must be an integer, not float 1.5"),
           (("0", [0]), "layer must be an integer, not str '0'"),
           ((0, [True]), "expert must be an integer, not bool True"),
           ((True, [0]), "layer must be an integer, not bool True"),
           ((0, [np.float32(2)]), "expert must be an integer, not float32"),
           ((0, 3), "experts must be a list of integers, not int 3"),
           ((0, [0], [(1, 2.0)]), "expert must be an integer, not float 2.0"),
           ((0, [0], [(1,)]), "must be a (layer, expert) pair")]
    with k3client.connect(d.endpoint, name="t") as c:
        for args, message in bad:
            with pytest.raises(k3client.BadRequest) as e:
                c.fetch(*args)
            assert message in str(e.value) and "\n" not in str(e.value)
        with pytest.raises(k3client.BadRequest, match="expert must be an integer, not bool False"):
            c.predict([(0, False)])
        ex = c.fetch(np.int64(1), [np.int32(2), 3])
        assert [(x.layer, x.expert) for x in ex] == [(1, 2), (1, 3)]
        assert c.status()["stats"]["bad_requests"] == 0      # nothing bad reached the daemon


def test_stopped_and_failed_daemons_leave_no_lock_and_no_directory(checkpoint, start_daemon, tmp_path):
    """The socket directory a daemon made goes when it stops (after serving or failing to
    start); one it found (tmp_path here) stays, empty."""
    made = tmp_path / "run" / "k3d"
    d = start_daemon(checkpoint, "--arena", "4MiB", endpoint=f"ipc://{made}/k3d.sock")
    assert sorted(os.listdir(made)) == ["k3d.sock", "k3d.sock.arena", "k3d.sock.arena.lock"]
    assert d.stop() == 0
    assert os.listdir(tmp_path) == []
    r = k3d("start", "--source", str(tmp_path / "missing"), "--endpoint", f"ipc://{made}/k3d.sock")
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert os.listdir(tmp_path) == []
