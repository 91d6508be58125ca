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
    code = "not_running"


class ProtocolMismatch(K3Error):
    code = "version_mismatch"


class BadRequest(K3Error):
    code = "bad_request"


class UnknownExpert(K3Error):
    code = "unknown_expert"


class CacheFull(K3Error):
    code = "cache_full"


class SlotsBusy(K3Error):
    """The slots a fetch needs still wait until other clients' views of them end; the
    client retries (``k3client`` does, within its timeout)."""
    code = "slots_busy"


class QuotaExceeded(K3Error):
    code = "quota_exceeded"


class ReadFailed(K3Error):
    code = "read_failed"


class NotAttached(K3Error):
    code = "not_attached"


class ShuttingDown(K3Error):
    code = "shutting_down"


class DaemonRestarted(K3Error):
    code = "daemon_restarted"


class PermissionDenied(K3Error):
    code = "permission_denied"


class Timeout(K3Error):
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
        DaemonRestarted, PermissionDenied, Timeout, Starting,
    )
}


def from_wire(code: str, message: str) -> K3Error:
    """The exception for an error reply; unknown codes become ``K3Error``."""
    return _BY_CODE.get(code, K3Error)(message)
