"""One daemon per endpoint: the flock'ed ``ARENA_SOCK.lock`` and the socket directories.

``claim_endpoint`` makes the socket directories (0750, those above them at most
0755), refuses a directory another user owns or every user may write (whoever can
rename or create entries there can take the endpoint over; clients refuse it too,
``k3client/trust.py``), flocks ``ARENA_SOCK.lock`` and removes the sockets a dead
daemon left (``kill -9``), refusing a live one's.  The ``Claim`` it returns holds
the lock for the daemon's life, so a second ``k3d start`` on the endpoint is
refused even while the first is still building its arena and answers nothing.

Invariants: the lock is the file at ``ARENA_SOCK.lock`` whose inode the holder
has flock'ed; ``Claim.release`` unlinks it while still holding it, so a daemon
that opened the old file meanwhile sees it replaced and tries the new one.  Every
exit, a failed start included, removes the lock file and the directories the claim
made (when nothing else is left in them).  The kernel drops the lock when the
process dies, however it dies.

Thread: the main thread of ``k3d start`` (``k3d.service.daemon``), before anything
binds and after the server loop has returned.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket

from k3client.endpoint import ipc_path

from .starting import StartupError

log = logging.getLogger("k3d")


class Claim:
    """The endpoint held: the flock'ed lock file's fd and the directories made for it."""

    def __init__(self, fd: int, path: str, made: list[str]):
        self.fd, self.path, self.made = fd, path, made

    def release(self) -> None:
        """Unlink the lock file while still holding it, then close: a daemon that opened
        the same file meanwhile sees it replaced and opens the new one (``claim_endpoint``)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self.fd)
        _remove_empty(self.made)


def claim_endpoint(endpoint: str, arena_sock: str) -> Claim:
    """Make the socket directory; refuse a live daemon's endpoint, clear a dead one's.

    Returns the ``Claim`` of ``ARENA_SOCK.lock``, flock'ed for the daemon's life: a second
    ``k3d start`` on the endpoint is refused even while the first is still building its
    arena (its sockets do not answer yet, and binding over them would strand it).  The
    kernel drops the lock when the process dies, however it dies."""
    dirs = [os.path.dirname(arena_sock)]
    if ipc_path(endpoint):
        dirs.append(os.path.dirname(ipc_path(endpoint)))
    lock_path = arena_sock + ".lock"
    made: list[str] = []
    while True:
        for d in dirs:
            made += _makedirs(d)
            _check_socket_dir(d)
        try:
            lock = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:        # a daemon leaving removed the directory just now
            continue
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(lock)
            _remove_empty(made)
            raise StartupError(f"another k3d is starting or serving at {endpoint} (it holds {lock_path}); "
                               "stop it first") from None
        try:                             # the file a leaving daemon unlinked is not the lock any more
            if os.stat(lock_path).st_ino == os.fstat(lock).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(lock)
    claim = Claim(lock, lock_path, made)
    try:
        _clear_stale(endpoint, arena_sock)
    except BaseException:
        claim.release()
        raise
    return claim


def _makedirs(d: str) -> list[str]:
    """``os.makedirs(d, 0o750)``, the directories above it at most 0755 (not 0777 less the
    umask: clients refuse a world-writable one, ``k3client/trust.py``); returns the
    directories it created, outermost first."""
    missing = []
    while d and not os.path.isdir(d):
        missing.append(d)
        d = os.path.dirname(d)
    made = []
    for m in reversed(missing):
        try:
            os.mkdir(m, 0o750 if m == missing[0] else 0o755)
            made.append(m)
        except FileExistsError:
            pass
    return made


def _remove_empty(dirs: list[str]) -> None:
    for d in reversed(dirs):             # innermost first; one still in use is not empty
        try:
            os.rmdir(d)
        except OSError:
            pass


def _clear_stale(endpoint: str, arena_sock: str) -> None:
    if os.path.exists(arena_sock):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            probe.connect(arena_sock)
            raise StartupError(f"another k3d is already serving at {endpoint} ({arena_sock} answers); stop it first")
        except (ConnectionRefusedError, FileNotFoundError):
            log.info("removing stale sockets left by a previous daemon at %s", endpoint)
            os.unlink(arena_sock)
            path = ipc_path(endpoint)
            if path and os.path.exists(path):
                os.unlink(path)
        finally:
            probe.close()


def _check_socket_dir(d: str) -> None:
    """The directory of the sockets must be this user's (or root's) and not writable by
    others, sticky or not: whoever can rename entries there can take the endpoint over (a
    /tmp/k3d-UID made first by someone else, say), and whoever can create them can bind
    the endpoint first.  Clients refuse such a directory too (``k3client/trust.py``)."""
    st = os.stat(d)
    if st.st_uid not in (os.geteuid(), 0):
        raise StartupError(f"socket directory {d} belongs to uid {st.st_uid}, not to this user: another user "
                           "could replace the sockets; remove it, or set XDG_RUNTIME_DIR or --endpoint")
    if st.st_mode & 0o002:
        raise StartupError(f"socket directory {d} is writable by every user (mode {st.st_mode & 0o7777:o}): "
                           "anyone could replace the sockets; chmod 750 it")
