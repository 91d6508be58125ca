"""What a client checks before it believes that the daemon answers at its endpoint.

Hits are answered from the arena the client maps, so whoever hands out that
memory decides every byte the model computes with.  At each (re-)attach, before
any view is built, the client's ``Attachment`` checks (each failure is
``errors.Untrusted``, one line naming what failed):

1. the ipc endpoint's directory: owned by a trusted uid (see below), not
   writable by others (sticky or not), and group-writable only when its group is
   the daemon group the user named; every directory above it (as given and as
   its symlinks resolve) owned by a trusted uid and not writable by others
   unless sticky (``/tmp``).  Whoever may write or rename there could put a
   socket of their own in the daemon's place.  k3d makes its socket directory
   0750 (``k3d/service/daemon.py``);
2. the process answering ``hello`` on the ipc socket (ZeroMQ's ``Peer-Address``:
   the kernel's SO_PEERCRED of the connection) runs as a trusted uid; the arena
   socket is the one beside the endpoint, whatever the reply names.  Over tcp,
   which carries no credentials, the arena socket the reply names is used once
   its directories pass as in 1: there, 3 and 4 are what is verified;
3. the process that serves the arena's hand-out socket (SO_PEERCRED, read before
   anything is received) runs as a trusted uid, and over ipc is the process that
   answered ``hello``;
4. both fds received (the arena and the shared index) are memfds sealed against
   writes (``F_SEAL_WRITE`` or ``F_SEAL_FUTURE_WRITE``) and against size changes
   (``F_SEAL_SHRINK`` and ``F_SEAL_GROW``): no process but the daemon's one
   writable mapping, made before sealing, can change them, and no truncation can
   turn a read into SIGBUS.  The daemon hands out no other kind of fd (hugepage
   arenas are sealed memfds too).

Trusted uids: this process's effective uid, root, and, when the user names a
group (``connect(daemon_group=...)``, else ``K3D_DAEMON_GROUP``; a name or a
gid), the members of that group: a uid whose passwd entry has it as primary
group or that the group lists, or a peer whose SO_PEERCRED gid is it.  A
system-wide daemon (``k3d install-unit``: user and group ``k3d``) needs
``K3D_DAEMON_GROUP=k3d`` in its clients' environment.

Pure checks on the file system and on fds the caller owns: safe from any thread.
"""

from __future__ import annotations

import fcntl
import grp
import os
import pwd
import stat

from .endpoint import ipc_path
from .errors import Untrusted

F_SEAL_FUTURE_WRITE = 0x0010        # Linux 5.1; not in Python's fcntl module
_WRITE_SEALS = fcntl.F_SEAL_WRITE | F_SEAL_FUTURE_WRITE
_SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_HINT = "if k3d runs as another user, name its group: K3D_DAEMON_GROUP=GROUP or connect(daemon_group=GROUP)"


class Trust:
    """The uids a client trusts to be its daemon, and the checks made with them."""

    def __init__(self, group: str | int | None = None):
        self.uid = os.geteuid()
        self.gid = self.group = None
        self.members: frozenset[str] = frozenset()
        if group is None or group == "":
            return
        numeric = str(group).isdigit()
        try:
            g = grp.getgrgid(int(group)) if numeric else grp.getgrnam(str(group))
        except (KeyError, ValueError, OverflowError):
            if not numeric:
                raise Untrusted(f"daemon group {group!r} (K3D_DAEMON_GROUP or connect(daemon_group=...)) "
                                "is no group of this machine; name the daemon's group, e.g. k3d") from None
            self.gid = self.group = int(group)       # a gid with no entry (a container): peers' gids only
            return
        self.gid, self.group, self.members = g.gr_gid, g.gr_name, frozenset(g.gr_mem)

    @classmethod
    def of(cls, daemon_group, env) -> "Trust":
        """``daemon_group`` if given, else ``K3D_DAEMON_GROUP`` from ``env``."""
        return cls(daemon_group if daemon_group is not None else env.get("K3D_DAEMON_GROUP"))

    def trusted(self, uid: int, gid: int | None = None) -> bool:
        """``uid`` (a peer's, with its SO_PEERCRED ``gid``; a file owner's without) may be the daemon."""
        if uid in (self.uid, 0):
            return True
        if self.gid is None:
            return False
        if gid is not None and gid == self.gid:
            return True
        try:
            pw = pwd.getpwuid(uid)
        except KeyError:
            return False
        return pw.pw_gid == self.gid or pw.pw_name in self.members

    def who(self) -> str:
        group = f" or group {self.group} (gid {self.gid})" if self.group is not None else ""
        return f"{'root (you)' if self.uid == 0 else f'you (uid {self.uid}), root'}{group}"

    # -- 1. directories --------------------------------------------------------
    def socket_dir(self, sock_path: str) -> None:
        """The directory holding ``sock_path`` and every one above it (see the module docstring)."""
        d = os.path.dirname(os.path.abspath(sock_path))
        real = os.path.realpath(d)
        if real != d:
            self._owned(d)                       # a symlink: its owner could point it elsewhere
        st = self._owned(real)
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o002:
            raise Untrusted(f"the k3d socket directory {d} is writable by every user (mode {mode:o}): anyone "
                            "could put their own socket there; chmod o-w it (k3d makes it 0750)")
        if mode & 0o020 and st.st_gid != self.gid:
            raise Untrusted(f"the k3d socket directory {d} is writable by group {_group(st.st_gid)} (mode {mode:o}), "
                            f"not the daemon group you named; chmod g-w it, or {_HINT}")
        seen = {d, real}
        for top in (os.path.dirname(d), os.path.dirname(real)):
            while top not in seen:               # the path as given and where it leads
                seen.add(top)
                st = self._owned(top)
                mode = stat.S_IMODE(st.st_mode)
                if mode & 0o002 and not mode & 0o1000 and not stat.S_ISLNK(st.st_mode):
                    raise Untrusted(f"{top}, above the k3d socket directory {d}, is writable by every user "
                                    f"(mode {mode:o}, not sticky): anyone could swap the directory; chmod o-w it")
                top = os.path.dirname(top)

    def _owned(self, d: str) -> os.stat_result:
        try:
            st = os.lstat(d)
        except OSError as e:
            raise Untrusted(f"cannot check the k3d socket directory {d}: {e.strerror}") from None
        if not self.trusted(st.st_uid):
            raise Untrusted(f"{d} (on the way to the k3d socket) belongs to uid {st.st_uid}, not to {self.who()}: "
                            f"whoever owns it could replace the daemon's sockets; {_HINT}")
        return st

    # -- 2, 3. peers -------------------------------------------------------------
    def hello_peer(self, peer: tuple[int, int, int] | None, endpoint: str, arena_socket: str) -> str:
        """The arena socket to attach: over ipc the one beside the endpoint (whatever the reply
        named), once the endpoint's directories and the process that answered ``hello``
        (``peer``: its uid, gid and pid) pass; over tcp (no credentials) the one the reply
        named, once its directories pass."""
        path = ipc_path(endpoint)
        if path is None:
            self.socket_dir(arena_socket)
            return arena_socket
        self.socket_dir(path)
        if peer is None:
            raise Untrusted(f"cannot tell who answers at {endpoint}: its reply carried no peer credentials")
        self.peer(peer, f"the process answering at {endpoint}")
        return path + ".arena"

    def peer(self, cred: tuple[int, int, int], what: str) -> None:
        uid, gid, pid = cred
        if not self.trusted(uid, gid):
            raise Untrusted(f"{what} runs as uid {uid} (pid {pid}), not as {self.who()}: not a daemon you trust; "
                            f"{_HINT}")

    # -- 4. the fds ----------------------------------------------------------
    @staticmethod
    def sealed(fd: int, what: str) -> None:
        """``fd`` is a memfd that no other process can write, shrink or grow."""
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            raise Untrusted(f"{what} is not a sealed memfd (no seals to read): its owner could change "
                            "the bytes under your views; not a k3d daemon") from None
        missing = [name for name, ok in (("write", seals & _WRITE_SEALS), ("shrink", seals & fcntl.F_SEAL_SHRINK),
                                         ("grow", seals & fcntl.F_SEAL_GROW)) if not ok]
        if missing:
            raise Untrusted(f"{what} lacks the {', '.join(missing)} seal{'s' * (len(missing) > 1)} "
                            f"(seals {seals:#x}): its owner could change the bytes under your views; "
                            "not a k3d daemon")


def _group(gid: int) -> str:
    try:
        return f"{grp.getgrgid(gid).gr_name} (gid {gid})"
    except KeyError:
        return f"gid {gid}"
