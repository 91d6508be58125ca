"""The client verifies what answers at its endpoint before it builds a view (``k3client/trust.py``).

- An impostor (``tests/impostor.py``: a real process, not the daemon, that binds
  the endpoint, answers hello as the daemon does and hands out fds over the
  arena socket) is refused in one line when what it hands out is not sealed, is
  not a memfd, or its hand-out socket listens as another user; the same process
  handing out memfds sealed as the daemon's is accepted (the control).
- A real daemon's socket directory, loosened after it started, is refused: writable
  by every user (sticky or not), group-writable by a group the user did not name,
  owned by another user (unless the user names that user's group), or below a
  world-writable, non-sticky directory.
- The daemon refuses to start in a world-writable directory even when it is sticky,
  and makes the directories above its own 0755 whatever the umask.
"""

import grp
import json
import os
import pwd
import subprocess
import sys
import tempfile

import pytest

import k3client
from conftest import SCRATCH
from helpers import TESTS, k3d

IMPOSTOR = os.path.join(TESTS, "impostor.py")


def fresh_dir() -> str:
    d = tempfile.mkdtemp(prefix="tr-", dir=SCRATCH)
    os.chmod(d, 0o750)
    return d


@pytest.fixture
def impostor():
    procs = []

    def start(kind: str) -> str:
        endpoint = f"ipc://{fresh_dir()}/k.sock"
        p = subprocess.Popen([sys.executable, IMPOSTOR, endpoint, kind], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        procs.append(p)
        line = p.stdout.readline().strip()
        assert line == "ready", p.stderr.read() if p.poll() is not None else line
        return endpoint

    yield start
    for p in procs:
        p.terminate()
        p.communicate(timeout=10)


def refused(endpoint: str, **kw) -> str:
    with pytest.raises(k3client.Untrusted) as e:
        k3client.connect(endpoint, name="victim", connect_timeout=5.0, **kw).close()
    message = str(e.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("kind, what", [
    ("unsealed-arena", r"the arena handed out at \S+ lacks the write, shrink, grow seals"),
    ("unsealed-index", r"the shared index handed out at \S+ lacks the write, shrink, grow seals"),
    ("file", r"the arena handed out at \S+ is not a sealed memfd"),
])
def test_impostor_handing_out_unsealed_memory_is_refused(impostor, kind, what):
    import re

    endpoint = impostor(kind)
    message = refused(endpoint)
    assert re.search(what, message), message
    assert "not a k3d daemon" in message


def test_impostor_with_sealed_memfds_is_accepted(impostor):
    """The control: the same process, handing out memfds sealed as the daemon's, attaches;
    so what the tests above refuse is the seals."""
    endpoint = impostor("sealed")
    with k3client.connect(endpoint, name="victim", connect_timeout=5.0) as c:
        assert c.gen == 4242 and c.slots == 4
        assert c.arena is not None and len(c.arena) >= 4 * 4096


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to listen as another user")
def test_impostor_listening_as_another_user_is_refused(impostor):
    endpoint = impostor("other-uid")
    message = refused(endpoint)
    assert "the process serving the arena at" in message and "runs as uid 65534" in message, message
    assert "K3D_DAEMON_GROUP" in message


# -- directories, with the real daemon ------------------------------------------------------
@pytest.fixture
def daemon(checkpoint, start_daemon):
    base = fresh_dir()
    d = start_daemon(checkpoint, "--slots", "4", endpoint=f"ipc://{base}/run/k.sock")
    d.sockdir = os.path.join(base, "run")
    d.base = base
    return d


def attaches(endpoint: str, **kw) -> None:
    with k3client.connect(endpoint, name="ok", **kw) as c:
        assert c.fetch(0, [1])[0].array("w1.weight_scale").size > 0


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o757])
def test_socket_directory_writable_by_every_user_is_refused(daemon, mode):
    attaches(daemon.endpoint)
    os.chmod(daemon.sockdir, mode)
    message = refused(daemon.endpoint)
    assert f"the k3d socket directory {daemon.sockdir} is writable by every user (mode {mode:o})" in message
    os.chmod(daemon.sockdir, 0o750)
    attaches(daemon.endpoint)


def test_group_writable_socket_directory_only_for_the_named_group(daemon):
    os.chmod(daemon.sockdir, 0o770)
    message = refused(daemon.endpoint)
    assert "is writable by group" in message and "not the daemon group you named" in message
    group = grp.getgrgid(os.stat(daemon.sockdir).st_gid).gr_name
    attaches(daemon.endpoint, daemon_group=group)


def test_directory_above_writable_by_every_user_is_refused_unless_sticky(daemon):
    os.chmod(daemon.base, 0o777)
    message = refused(daemon.endpoint)
    assert f"{daemon.base}, above the k3d socket directory" in message and "not sticky" in message
    os.chmod(daemon.base, 0o1777)            # /tmp's way: nobody renames what is not theirs
    attaches(daemon.endpoint)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_socket_directory_of_another_user_is_refused_unless_their_group_is_named(daemon):
    nobody = pwd.getpwnam("nobody")
    os.chown(daemon.sockdir, nobody.pw_uid, -1)
    try:
        message = refused(daemon.endpoint)
        assert f"{daemon.sockdir} (on the way to the k3d socket) belongs to uid {nobody.pw_uid}" in message
        attaches(daemon.endpoint, daemon_group=grp.getgrgid(nobody.pw_gid).gr_name)
        attaches(daemon.endpoint, daemon_group=str(nobody.pw_gid))      # a gid names it too
    finally:
        os.chown(daemon.sockdir, 0, -1)


def test_unknown_daemon_group_is_one_line(daemon, monkeypatch):
    monkeypatch.setenv("K3D_DAEMON_GROUP", "no-such-group-k3d")
    message = refused(daemon.endpoint)
    assert "daemon group 'no-such-group-k3d'" in message and "is no group of this machine" in message


# -- the daemon's side --------------------------------------------------------------------
def test_daemon_refuses_a_sticky_world_writable_socket_directory(checkpoint):
    d = fresh_dir()
    os.chmod(d, 0o1777)
    r = k3d("start", "--source", checkpoint, "--endpoint", f"ipc://{d}/k.sock", "--arena", "4MiB")
    assert r.returncode == 1 and f"socket directory {d} is writable by every user (mode 1777)" in r.stderr
    assert r.stderr.strip().count("\n") == 0, r.stderr


def test_daemon_makes_the_directories_above_its_own_0755_under_umask_0(checkpoint, start_daemon):
    base = fresh_dir()
    endpoint = f"ipc://{base}/a/b/k.sock"
    old = os.umask(0)                           # the daemon inherits it
    try:
        d = start_daemon(checkpoint, "--slots", "4", endpoint=endpoint)
    finally:
        os.umask(old)
    assert os.stat(f"{base}/a").st_mode & 0o7777 == 0o755
    assert os.stat(f"{base}/a/b").st_mode & 0o7777 == 0o750
    attaches(endpoint)
    assert d.stop() == 0


@pytest.mark.parametrize("args", [(), ("--no-thp",)])
def test_the_daemon_hands_out_memfds_with_every_seal_the_client_checks(checkpoint, start_daemon, args):
    import fcntl
    import socket

    d = start_daemon(checkpoint, "--slots", "4", *args)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.connect(d.endpoint[len("ipc://"):] + ".arena")
        _, fds, _, _ = socket.recv_fds(s, 4096, 2)
    try:
        assert len(fds) == 2
        want = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | 0x0010 | fcntl.F_SEAL_SEAL      # 0x10: FUTURE_WRITE
        assert [fcntl.fcntl(fd, fcntl.F_GET_SEALS) for fd in fds] == [want, want]
    finally:
        for fd in fds:
            os.close(fd)
    assert d.stop() == 0


def test_an_impostor_taking_over_after_a_restart_is_refused_at_the_reattach(checkpoint, start_daemon):
    """The daemon stops; a process that is not k3d binds its endpoint: the attached client's next
    request re-attaches, finds unsealed memory and raises, and keeps refusing (no view, no channel)."""
    endpoint = f"ipc://{fresh_dir()}/k.sock"
    d = start_daemon(checkpoint, "--slots", "4", endpoint=endpoint)
    c = k3client.connect(endpoint, name="victim", reconnect_timeout=10.0)
    try:
        ex = c.fetch(0, [1])[0]
        assert d.stop() == 0
        same = {"layout": [t.to_wire() for t in c.layout], "expert_bytes": c.expert_bytes, "slots": c.slots,
                "slot_bytes": c.slot_bytes, "model": c.model}        # it passes for the daemon that left
        p = subprocess.Popen([sys.executable, IMPOSTOR, endpoint, "unsealed-arena", json.dumps(same)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert p.stdout.readline().strip() == "ready", p.stderr.read()
            for _ in range(2):
                with pytest.raises(k3client.Untrusted, match="lacks the write, shrink, grow seals"):
                    c.fetch(0, [1])
            with pytest.raises(k3client.K3Error):
                ex.array("w1.weight_scale")           # bound to the daemon that went away
        finally:
            p.terminate()
            p.communicate(timeout=10)
    finally:
        c.close()
