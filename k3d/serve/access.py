"""Who may use the daemon: the daemon's uid, root, or a member of its group.

Both sockets are created 0660 in a 0750 directory (the file modes are the first
gate); every peer is then checked again from its kernel credentials, so a
socket whose mode was loosened by mistake still refuses strangers: ZeroMQ's
``Peer-Address`` property (``localhost:uid:gid:pid`` over ipc) on hello, and
SO_PEERCRED on the arena socket.  Pure functions, safe from any thread, except
``private_umask`` (the process umask: the server thread, before serving).

A client's name is admitted escaped (``printable``, ``k3d.serve.names``): every log line, status and
``k3ctl status`` shows it so, and a newline or terminal escape in it can neither
forge a log line nor redraw a terminal.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
from contextlib import contextmanager

import zmq

from k3client.errors import BadRequest, PermissionDenied

from .names import printable

log = logging.getLogger("k3d")


@contextmanager
def private_umask():
    """Sockets bound inside are born 0660: only the daemon's user and group may
    connect.  (Callers chmod again after binding, in case the umask was ignored.)"""
    old = os.umask(0o117)
    try:
        yield
    finally:
        os.umask(old)


def peer_cred(frame) -> tuple[int | None, int | None, int | None]:
    """(uid, gid, pid) of an ipc peer from ``Peer-Address``; Nones over tcp."""
    try:
        parts = frame.get("Peer-Address").split(":")
        return int(parts[1]), int(parts[2]), int(parts[3])
    except (zmq.ZMQError, AttributeError, IndexError, ValueError):
        return None, None, None


def admit(hello: dict, frame) -> tuple[str, int | None]:
    """(name, pid) of a client saying ``hello`` in ``frame``, if its peer may attach;
    raises BadRequest (no name) or PermissionDenied (logged).  The name comes back
    ``printable`` (its first 200 characters); the ipc peer's pid wins over the one
    the message claims."""
    name = hello.get("name")
    if not isinstance(name, str) or not name:
        raise BadRequest("hello: name must be a non-empty string")
    name = printable(name[:200])
    uid, gid, pid = peer_cred(frame)
    if not peer_allowed(uid, gid, pid):
        log.warning("refused client %r: uid %s gid %s pid %s is not allowed", name, uid, gid, pid)
        raise PermissionDenied(refusal(uid, gid, pid))
    if pid is None and type(hello.get("pid")) is int:
        pid = hello["pid"]
    return name, pid


def unix_peer_cred(conn: socket.socket) -> tuple[int, int, int]:
    """(uid, gid, pid) of a connected Unix socket's peer (SO_PEERCRED)."""
    pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                         struct.calcsize("3i")))
    return uid, gid, pid


def peer_allowed(uid, gid, pid) -> bool:
    """Same uid as the daemon, root, or a member of the daemon's gid.

    ``uid is None`` (a tcp peer: no credentials) is allowed; access control
    needs an ipc endpoint.  Supplementary groups are read from the peer's
    /proc status (the process's real credentials, not the group database)."""
    if uid is None or uid == 0 or uid == os.getuid():
        return True
    mine = os.getgid()
    if gid == mine:
        return True
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return str(mine) in line.split()[1:]
    except (OSError, TypeError):
        pass
    return False


def refusal(uid, gid, pid) -> str:
    return (f"permission denied: uid {uid} (pid {pid}) is not k3d's user (uid {os.getuid()}), root, "
            f"or in k3d's group (gid {os.getgid()}); add the user to that group")
