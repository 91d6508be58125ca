"""Typed errors shared by the daemon and its clients.

Every error that crosses the wire is a ``(code, message)`` pair; ``code`` picks
the exception class on the client side (``from_wire``), ``message`` is a single
line a person can act on.  The daemon raises these same classes internally and
one place in the daemon's request loop (``k3d.serve.loop``) turns them into error replies
(any other exception there becomes a plain ``K3Error`` "internal error" reply).
Plain classes, no state: used from any thread.
"""

from __future__ import annotations


class K3Error(Exception):
    """Base class of every k3d error; ``code`` is the wire name."""

    code = "error"


class DaemonNotRunning(K3Error):
    """Nothing answers at the endpoint (no socket, no reply to hello, or re-attaching after a restart timed out)."""

    code = "not_running"


class ProtocolMismatch(K3Error):
    """The client and the daemon speak different protocol versions: install the same k3d for both."""

    code = "version_mismatch"


class BadRequest(K3Error):
    """The request is malformed: keys that are not integers, a fetch of zero keys, a bad field."""

    code = "bad_request"


class UnknownExpert(K3Error):
    """A layer or expert the daemon does not serve; the message names the ranges it does."""

    code = "unknown_expert"


class CacheFull(K3Error):
    """Every slot is pinned: the fetch cannot be placed (more slots, fewer clients, or ``--pin-quota``)."""

    code = "cache_full"


class SlotsBusy(K3Error):
    """The slots a fetch needs still wait until other clients' views of them end; the
    client retries (``k3client`` does, within its timeout)."""
    code = "slots_busy"


class QuotaExceeded(K3Error):
    """This client pinned more than ``--pin-quota`` slots in one token."""

    code = "quota_exceeded"


class ReadFailed(K3Error):
    """The source failed for an expert (disk error, corrupt packed expert, origin down); the next fetch retries."""

    code = "read_failed"


class NotAttached(K3Error):
    """A request before ``hello``, or from a client the daemon dropped (dead, silent past its lease)."""

    code = "not_attached"


class ShuttingDown(K3Error):
    """The daemon is stopping; the client re-attaches to the next one within ``reconnect_timeout``."""

    code = "shutting_down"


class DaemonRestarted(K3Error):
    """The daemon restarted: an ``Expert`` of the old one, a changed layout, or ``reconnect_timeout=0``."""

    code = "daemon_restarted"


class Expired(K3Error):
    """An ``Expert`` whose pin has ended (this client's ``begin_token()``, ``close()``, or its
    ``release_layer()`` of the expert's layer since the fetch): its slot may hold another
    expert now, so no view of it is built.  Client side only; fetch it again."""

    code = "expired"


class PermissionDenied(K3Error):
    """This process may not use the daemon: it is not the daemon's user, root, or in its group."""

    code = "permission_denied"


class Untrusted(K3Error):
    """What answers at the endpoint is not shown to be the daemon (``k3client/trust.py``):
    a stranger's socket, directory or process, or an arena another process could change.
    Raised before any view is built; the message names what failed."""
    code = "untrusted"


class Timeout(K3Error):
    """A reply took longer than the client's ``timeout`` (a very cold origin, a stalled daemon)."""

    code = "timeout"


class Starting(K3Error):
    """The daemon is still building its arena; the message says how far (``connect(wait=...)`` waits)."""

    code = "starting"


class Mismatch(Exception):
    """The daemon serves another checkpoint than the one a client loads (one line naming both).

    Raised on the client side only (``Client.verify``, the loaders' fingerprint); never on the wire."""


_BY_CODE = {
    cls.code: cls
    for cls in (
        K3Error, DaemonNotRunning, ProtocolMismatch, BadRequest, UnknownExpert,
        CacheFull, SlotsBusy, QuotaExceeded, ReadFailed, NotAttached, ShuttingDown,
        DaemonRestarted, PermissionDenied, Timeout, Starting, Untrusted,
    )
}


def from_wire(code: str, message: str) -> K3Error:
    """The exception for an error reply; unknown codes become ``K3Error``."""
    return _BY_CODE.get(code, K3Error)(message)
