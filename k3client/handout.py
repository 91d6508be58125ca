"""Receiving the arena: the client's side of the daemon's hand-out (``k3d/serve/handout.py``).

Wire: connect to the path ``hello`` named (SOCK_SEQPACKET) and receive one
packet: msgpack ``{gen, ...}`` with two fds (SCM_RIGHTS), the arena's sealed
memfd and the shared index's; a refused peer gets one line of text and no fd.

``receive`` maps the whole arena read-only and returns the index's fd, which the
caller owns (and closes) from then on; on any error every received fd is
closed and nothing is mapped.  The mapping covers the memfd's whole length: a
hugetlb arena is rounded up to whole huge pages, and a mapping of a length
that is not a multiple of them could never be unmapped.

Trust (``trust.py``): the listening process's SO_PEERCRED is checked before
anything is received (a trusted uid and, over ipc, the pid that answered
``hello``), and both fds must be sealed memfds before anything is mapped: a
failure is ``Untrusted``.

Called by the client's ``Attachment`` on the client's thread, at each (re-)attach.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct

from . import errors
from .protocol import unpack
from .trust import Trust


def receive(path: str, size: int, gen: int, trust: Trust, pid: int | None = None) -> tuple[mmap.mmap, int | None]:
    """(the arena ``path`` hands out, mapped read-only; the shared index's fd, or None if
    none came).  ``size``: the arena's bytes as ``hello`` said; ``gen``: its generation
    (another one: the daemon restarted in between, ``DaemonRestarted``); ``pid``: the
    process that answered ``hello`` (None over tcp), which must be the one serving ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(5.0)
        try:
            s.connect(path)
            peer_pid, uid, gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                  struct.calcsize("3i")))
        except OSError as e:
            raise errors.DaemonNotRunning(f"cannot attach the arena at {path}: {e}") from None
        trust.peer((uid, gid, peer_pid), f"the process serving the arena at {path}")
        if pid is not None and peer_pid != pid:
            raise errors.Untrusted(f"the arena at {path} is served by pid {peer_pid}, but pid {pid} answered hello: "
                                   "not one k3d daemon")
        try:
            msg, fds, _, _ = socket.recv_fds(s, 4096, 2)
        except OSError as e:
            raise errors.DaemonNotRunning(f"cannot attach the arena at {path}: {e}") from None
    if not fds:
        raise errors.PermissionDenied(
            f"the daemon refused to hand out the arena at {path}: {msg.decode(errors='replace')}")
    fd, index_fd = fds[0], (fds[1] if len(fds) > 1 else None)    # (recv_fds gives at most 2)
    try:
        trust.sealed(fd, f"the arena handed out at {path}")
        if index_fd is not None:
            trust.sealed(index_fd, f"the shared index handed out at {path}")
        meta = unpack(msg)
        if meta["gen"] != gen:
            raise errors.DaemonRestarted("the daemon restarted while attaching; connect again")
        whole = os.fstat(fd).st_size
        if whole < size:
            raise errors.ProtocolMismatch(f"the arena at {path} holds {whole} bytes, the daemon said {size}")
        return mmap.mmap(fd, whole, mmap.MAP_SHARED, mmap.PROT_READ), index_fd
    except BaseException:
        if index_fd is not None:
            os.close(index_fd)
        raise
    finally:
        os.close(fd)
