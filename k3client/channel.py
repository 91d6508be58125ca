"""One connection to one daemon: request/reply on a DEALER socket, and noticing it went away.

A ``Channel`` lives for one attachment; the client makes a new one to
re-attach.  The daemon it talks to went away (``Gone``) when, while a request
waits: a reply's ``gen`` differs from the one its hello named, the daemon
process exits (a pidfd on it, from the hello reply's ipc peer credentials,
polled beside the socket), the ipc socket file is replaced (checked at least
every 0.5 s: over tcp, or on a kernel without pidfds), or the daemon answers
``ShuttingDown``.  A reply to an earlier request that timed out is skipped.

Thread: a ``Channel`` belongs to its client's thread (a DEALER socket is not
thread-safe).
"""

from __future__ import annotations

import itertools
import os
import time

import zmq

from . import errors
from .endpoint import ipc_path
from .protocol import MAX_REPLY_BYTES, PROTOCOL_VERSION, pack_request, unpack

POLL_S = 0.5     # the longest a waiting request goes without checking the socket file


class Gone(errors.DaemonRestarted):
    """The daemon this channel attached to went away or was replaced."""


def socket_inode(endpoint: str) -> int | None:
    """The inode of an ipc endpoint's socket file (None over tcp, or with no file)."""
    path = ipc_path(endpoint)
    try:
        return os.stat(path).st_ino if path else None
    except OSError:
        return None


class Channel:
    def __init__(self, ctx: zmq.Context, endpoint: str):
        """Connect a DEALER socket to ``endpoint`` (ZeroMQ connects lazily: nothing is
        known of the daemon until ``request("hello")`` is answered)."""
        self.endpoint = endpoint
        self.gen = None              # the daemon's generation, once its hello reply names it
        self.pidfd = None            # the daemon process, once known (ipc only)
        self.peer = None             # its (uid, gid, pid) from the hello reply (ipc only)
        self._ids = itertools.count(1)
        self._ino = socket_inode(endpoint)
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
        try:
            self._sock.connect(endpoint)
        except zmq.ZMQError as e:
            self._sock.close(0)
            raise errors.DaemonNotRunning(
                f"cannot connect to {endpoint}: {e.strerror} "
                "(use ipc:///path/k3d.sock or tcp://host:port)") from None
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)

    def send(self, op: str, **fields) -> None:
        """Send ``op`` without waiting for a reply."""
        msg = {"v": PROTOCOL_VERSION, "op": op, "id": next(self._ids)}
        msg.update(fields)
        self._sock.send(pack_request(msg))

    def request(self, op: str, timeout: float | None, **fields) -> dict:
        """Send ``op`` and wait up to ``timeout`` seconds (None: forever) for its reply.
        Raises ``Gone``, ``errors.Timeout``, or the error the daemon answered."""
        return self.wait(self.post(op, **fields), op, timeout)

    def post(self, op: str, **fields) -> int:
        """Send ``op`` as a request whose reply ``wait(id)`` collects later; returns its id."""
        rid = next(self._ids)
        msg = {"v": PROTOCOL_VERSION, "op": op, "id": rid}
        msg.update(fields)
        self._sock.send(pack_request(msg))
        return rid

    def wait(self, rid: int, op: str, timeout: float | None) -> dict:
        """The reply to request ``rid`` (``op`` names it in errors), as ``request`` returns it;
        replies to earlier requests are skipped."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            now = time.monotonic()
            wait = POLL_S if deadline is None else max(0.0, min(POLL_S, deadline - now))
            events = dict(self._poller.poll(int(wait * 1000)))
            if self._sock not in events:
                if self.gen is not None:
                    if self.pidfd is not None and self.pidfd in events:
                        raise Gone(f"the daemon process exited during {op}")
                    if socket_inode(self.endpoint) != self._ino:
                        raise Gone(f"the daemon's socket was replaced during {op}")
                if deadline is not None and time.monotonic() >= deadline:
                    raise errors.Timeout(f"{op}: no reply from {self.endpoint} in {timeout:g}s")
                continue
            frame = self._sock.recv(copy=False)
            reply = unpack(frame.bytes)
            if reply.get("id") != rid:
                continue  # a late reply to a request that timed out earlier
            if self.gen is not None and reply.get("gen") != self.gen:
                raise Gone(f"the daemon at {self.endpoint} restarted (generation changed)")
            if not reply.get("ok"):
                e = reply.get("error") or {}
                code = e.get("code", "error")
                if code == errors.ShuttingDown.code and self.gen is not None:
                    raise Gone(f"the daemon shut down during {op}")
                raise errors.from_wire(code, e.get("message", "unknown error"))
            if op == "hello":
                self.gen = reply["gen"]
                self._watch_daemon(frame)
            return reply

    def _watch_daemon(self, frame) -> None:
        """``peer`` and a pidfd on the daemon, from the reply's ipc peer credentials."""
        try:
            uid, gid, pid = (int(x) for x in frame.get("Peer-Address").split(":")[1:])
            self.peer = (uid, gid, pid)
            self.pidfd = os.pidfd_open(pid)
        except (zmq.ZMQError, AttributeError, IndexError, ValueError, OSError):
            return   # tcp or an old kernel: the socket-inode check still works
        self._poller.register(self.pidfd, zmq.POLLIN)

    def close(self) -> None:
        self._sock.close(0)
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
