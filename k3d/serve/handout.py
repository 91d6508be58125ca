"""Arena hand-out: the arena's fd, passed to each allowed client over a Unix socket.

Wire: the client connects to ``<endpoint path>.arena`` (SOCK_SEQPACKET) and
receives one packet: msgpack ``{gen, arena_bytes, index_bytes, slot_bytes, slots}``
with two fds attached (SCM_RIGHTS): the arena's and the shared index's.  Both are
sealed memfds (``memory/arena.py``, ``memory/index.py``), so what a client maps is
read-only whatever it asks for.  A
peer that ``access.peer_allowed`` refuses gets one line of text and no fd.

The socket is bound 0660 by the caller (``access.private_umask``) and removed by
``close``.  Accepting never blocks the loop: the socket is non-blocking, each
connection gets its one packet or nothing, and EMFILE leaves the waiting
client for the next poll while everyone else is served.

Thread: the server thread owns the socket (``serve`` runs in its loop).
"""

from __future__ import annotations

import logging
import os
import socket

from k3client.protocol import pack
from k3d.serve.access import peer_allowed, refusal, unix_peer_cred

log = logging.getLogger("k3d")


class ArenaHandout:
    def __init__(self, path: str, arena, gen: int, index):
        self.path, self.arena, self.gen, self.index = path, arena, gen, index
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)

    def bind(self) -> None:
        """Bind and listen (call under ``private_umask``; the mode is set again after)."""
        self.listener.bind(self.path)
        os.chmod(self.path, 0o660)
        self.listener.listen(64)
        self.listener.setblocking(False)

    def fileno(self) -> int:
        return self.listener.fileno()

    def serve(self) -> None:
        """Answer every connection waiting now."""
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:   # EMFILE/ENFILE: this client waits; everyone else is served
                log.warning("cannot accept an arena connection: %s", e)
                return
            with conn:
                conn.setblocking(False)
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        try:
            uid, gid, pid = unix_peer_cred(conn)
        except OSError:
            return
        if not peer_allowed(uid, gid, pid):
            log.warning("refused the arena to uid %d gid %d pid %d: not allowed", uid, gid, pid)
            try:
                conn.send(refusal(uid, gid, pid).encode())
            except OSError:
                pass
            return
        meta = pack({"gen": self.gen, "arena_bytes": self.arena.size, "index_bytes": self.index.size,
                     "slot_bytes": self.arena.slot_bytes, "slots": self.arena.slots})
        try:
            socket.send_fds(conn, [meta], [self.arena.fd, self.index.fd])
        except OSError as e:
            log.warning("could not hand out the arena: %s", e)

    def close(self) -> None:
        """Stop accepting and remove the socket file."""
        self.listener.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
