"""Quotas and permissions against a real daemon.

- Pin quota: one client over its quota gets QuotaExceeded (and nothing of its
  fetch is pinned); the other clients are unaffected.
- Sockets are 0660 in a 0750 directory; the arena is read-only for clients
  (a write through a view fails; mapping the received memfd writable fails:
  F_SEAL_FUTURE_WRITE).
- Another user is kept out: by the file modes first, and when those are
  loosened by mistake, by the daemon's peer-credential check (hello and the
  arena handout) with a log line.  Members of the daemon's group get in.

The other-user tests need root: they create a system user with useradd (and
remove it afterwards) and run a client process that drops to that uid after
importing k3client (the interpreter under /root is not readable by others).
"""

import json
import mmap
import os
import pwd
import socket
import subprocess
import sys
import tempfile

import numpy as np
import pytest

import k3client
from conftest import SCRATCH
from k3client.protocol import unpack

OTHER = "k3dtest-other"


def fresh_endpoint(subdir=True):
    base = tempfile.mkdtemp(prefix="k3d-p-", dir=SCRATCH)
    return f"ipc://{base}/run/k.sock" if subdir else f"ipc://{base}/k.sock", base


# -- quota -------------------------------------------------------------------------
def test_over_quota_client_gets_clear_error_others_unaffected(checkpoint, start_daemon):
    d = start_daemon(checkpoint, "--slots", "16", "--pin-quota", "3")
    with k3client.connect(d.endpoint, name="greedy") as greedy, k3client.connect(d.endpoint, name="polite") as polite:
        greedy.fetch(0, [0, 1])
        with pytest.raises(k3client.QuotaExceeded, match=r"would pin 4 slots, the quota is 3 per client"):
            greedy.fetch(0, [2, 3])
        st = {c["name"]: c for c in polite.status()["clients"]}
        assert st["greedy"]["pins"] == 2                   # the refused fetch pinned nothing
        assert polite.status()["arena"]["loading"] == 0
        for layer in range(3):                             # the others fetch their full quota
            polite.begin_token()
            exs = polite.fetch(layer, [5, 6, 7])
            assert [e.expert for e in exs] == [5, 6, 7]
        greedy.fetch(0, [1, 2])                            # still within quota: fine
        greedy.begin_token()
        greedy.fetch(1, [0, 1, 2])                         # a new token, a fresh quota
        # a flood of predictions is capped at the quota too
        greedy.begin_token()
        queued = greedy.predict([(3, e) for e in range(16)])
        assert queued <= 3
        st = {c["name"]: c for c in polite.status()["clients"]}
        assert st["polite"]["pins"] == 3


# -- modes and read-only arena ---------------------------------------------------------
def test_sockets_0660_directory_0750(checkpoint, start_daemon):
    endpoint, base = fresh_endpoint(subdir=True)
    d = start_daemon(checkpoint, "--slots", "4", endpoint=endpoint)
    path = endpoint[len("ipc://"):]
    assert os.stat(path).st_mode & 0o777 == 0o660
    assert os.stat(path + ".arena").st_mode & 0o777 == 0o660
    assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o750
    assert d.stop() == 0


def test_views_are_read_only_and_the_memfd_cannot_be_mapped_writable(checkpoint, start_daemon):
    d = start_daemon(checkpoint, "--slots", "4")
    with k3client.connect(d.endpoint, name="ro") as c:
        ex = c.fetch(0, [3])[0]
        a = ex.array("w1.weight_packed")
        with pytest.raises(ValueError, match="read-only"):
            a[0, 0] = 1
        with pytest.raises(ValueError):
            np.copyto(a, 0)
        with pytest.raises(TypeError):
            ex.memory()[0] = 1
        # the fd a client receives: no writable mapping, no write(2)
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.connect(d.endpoint[len("ipc://"):] + ".arena")
            msg, fds, _, _ = socket.recv_fds(s, 4096, 1)
        fd = fds[0]
        try:
            size = unpack(msg)["arena_bytes"]
            with pytest.raises(PermissionError):
                mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(PermissionError):
                os.pwrite(fd, b"x", 0)
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size * 2)
            ro = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
            base = ex.slot * c.slot_bytes
            assert ro[base:base + 64] == bytes(ex.memory()[:64])
            ro.close()
        finally:
            os.close(fd)
        assert np.array_equal(ex.array("w1.weight_packed"), a)   # nothing changed


# -- other users -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def other_user():
    if os.geteuid() != 0:
        pytest.skip("needs root to create a user and switch to it")
    created = False
    try:
        pwd.getpwnam(OTHER)
    except KeyError:
        r = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"useradd failed: {r.stderr.strip()}")
        created = True
    pw = pwd.getpwnam(OTHER)
    yield pw.pw_uid, pw.pw_gid
    if created:
        subprocess.run(["userdel", OTHER], capture_output=True)


AS_USER = r"""
import json, os, socket, sys
import numpy as np, zmq, msgpack, k3client
from k3client import connect   # loaded before the uid drops: this Python's files may be root's alone
from k3client.errors import K3Error
endpoint, uid, gid, groups = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
os.setgroups(groups); os.setgid(gid); os.setuid(uid)
out = {"uid": os.getuid()}
try:
    with k3client.connect(endpoint, name="other", connect_timeout=1.0) as c:
        out["fetched"] = int(c.fetch(0, [1])[0].array("w1.weight_scale").sum())
except K3Error as e:
    out["error"], out["message"] = type(e).__name__, str(e)
try:   # straight to the arena socket, bypassing hello
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(3)
        s.connect(endpoint[len("ipc://"):] + ".arena")
        msg, fds, _, _ = socket.recv_fds(s, 4096, 1)
        out["arena_fds"], out["arena_msg"] = len(fds), msg[:200].decode(errors="replace")
except OSError as e:
    out["arena_error"] = type(e).__name__
print(json.dumps(out))
"""


def as_user(endpoint, uid, gid, groups=()):
    r = subprocess.run([sys.executable, "-c", AS_USER, endpoint, str(uid), str(gid), json.dumps(list(groups))],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_other_user_is_kept_out_by_file_modes(checkpoint, start_daemon, other_user):
    uid, gid = other_user
    endpoint, base = fresh_endpoint(subdir=True)
    d = start_daemon(checkpoint, "--slots", "4", endpoint=endpoint)
    os.chmod(base, 0o755)                 # the parent is open; k3d's own 0750 dir is not
    out = as_user(endpoint, uid, gid)
    assert out["uid"] == uid
    assert out["error"] == "PermissionDenied" and "fetched" not in out, out
    assert "no permission to enter" in out["message"] and "usermod -aG" in out["message"]
    assert out["arena_error"] in ("PermissionError", "FileNotFoundError")
    assert d.stop() == 0


def test_other_user_refused_by_peer_credentials_with_a_log_line(checkpoint, start_daemon, other_user):
    uid, gid = other_user
    endpoint, base = fresh_endpoint(subdir=True)
    d = start_daemon(checkpoint, "--slots", "4", endpoint=endpoint)
    path = endpoint[len("ipc://"):]
    for p, mode in ((base, 0o755), (os.path.dirname(path), 0o755), (path, 0o666), (path + ".arena", 0o666)):
        os.chmod(p, mode)                 # an admin loosened the modes by mistake
    out = as_user(endpoint, uid, gid)
    assert out["error"] == "PermissionDenied", out
    assert f"uid {uid}" in out["message"] and "group" in out["message"]
    assert out["arena_fds"] == 0 and "permission denied" in out["arena_msg"]
    log = d.log()
    assert f"refused client 'other': uid {uid}" in log
    assert f"refused the arena to uid {uid}" in log
    with k3client.connect(endpoint, name="owner") as c:      # the owner is unaffected
        assert [x["name"] for x in c.status()["clients"]] == ["owner"]
    assert d.stop() == 0


@pytest.mark.parametrize("how", ["primary", "supplementary"])
def test_member_of_daemon_group_gets_in(checkpoint, start_daemon, other_user, how):
    uid, gid = other_user
    endpoint, base = fresh_endpoint(subdir=True)
    d = start_daemon(checkpoint, "--slots", "4", endpoint=endpoint)
    os.chmod(base, 0o755)
    dgid = os.getgid()
    out = as_user(endpoint, uid, dgid, []) if how == "primary" else as_user(endpoint, uid, gid, [dgid])
    assert "error" not in out, out
    assert out["fetched"] > 0 and out["arena_fds"] == 1
    assert d.stop() == 0


def test_wasted_predictions_are_throttled_useful_ones_are_not(checkpoint, start_daemon):
    d = start_daemon(checkpoint, "--slots", "16", "--pin-quota", "4")
    with k3client.connect(d.endpoint, name="flood") as bad, k3client.connect(d.endpoint, name="useful") as good:
        bad_q, good_q = [], []
        for t in range(20):
            bad.begin_token()
            good.begin_token()
            # the flooder never fetches what it predicts
            bad_q.append(bad.predict([(t % 2, (4 * (t // 2) + i) % 16) for i in range(4)]))
            keys = [(2 + t % 2, (4 * (t // 2) + i) % 16) for i in range(4)]
            good_q.append(good.predict(keys))
            good.fetch(keys[0][0], [e for _, e in keys])     # uses every prediction
        assert max(bad_q[12:]) <= 1, bad_q            # ~all unused for 11+ tokens: one read per token
        assert sum(bad_q[:5]) > 5                      # not before
        assert sum(good_q[12:]) > len(good_q[12:]), good_q
