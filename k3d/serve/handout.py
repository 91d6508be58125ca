"""Arena hand-out: the arena's fd, passed to each allowed client over a Unix socket.

Wire: the client connects to ``<endpoint path>.arena`` (SOCK_SEQPACKET) and
receives one packet: msgpack ``{gen, arena_bytes, index_bytes, slot_bytes, slots}``
with two fds attached (SCM_RIGHTS): the arena's and the shared index's.  Both are
sealed memfds (``memory/arena.py``, ``memory/index.py``), so what a client maps is
read-only whatever it asks for.  A
peer that ``access.peer_allowed`` refuses gets one line of text and no fd.

The socket is bound 0660 by the caller (``access.private_umask``) and removed by
``close``.  Each connection gets its one packet or nothing (the send never
waits), and EMFILE leaves the waiting client for the next try.

Thread: ``k3d-handout`` accepts and answers; it reads only what never changes
while the daemon runs (the two fds, their sizes, ``gen``) and touches nothing
the server thread owns, so the loop never polls this socket.  ``bind``,
``start`` and ``close`` are the server thread's; ``close`` shuts the listener
down, which ends the thread's ``accept``, and joins it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

from k3client.protocol import pack
from k3d.serve.access import peer_allowed, refusal, unix_peer_cred

log = logging.getLogger("k3d")


class ArenaHandout:
    def __init__(self, path: str, arena, gen: int, index):
        self.path, self.arena, self.gen, self.index = path, arena, gen, index
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._closed = False
        self._thread: threading.Thread | None = None

    def bind(self) -> None:
        """Bind and listen (call under ``private_umask``; the mode is set again after)."""
        self.listener.bind(self.path)
        os.chmod(self.path, 0o660)
        self.listener.listen(64)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name="k3d-handout", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        """Answer connections until ``close``."""
        while not self._closed:
            try:
                conn, _ = self.listener.accept()
            except InterruptedError:
                continue
            except OSError as e:
                if self._closed:
                    return
                # EMFILE/ENFILE: this client waits; a pause, not a spin
                log.warning("cannot accept an arena connection: %s", e)
                time.sleep(0.1)
                continue
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
        """Stop accepting (the thread ends) and remove the socket file."""
        self._closed = True
        try:
            self.listener.shutdown(socket.SHUT_RDWR)     # ends a blocked accept (Linux: EINVAL)
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self.listener.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
