"""k3client: the light client of the k3d expert cache (numpy, pyzmq, msgpack)."""

from .client import Client, Expert, connect
from .errors import (
    BadRequest,
    CacheFull,
    DaemonNotRunning,
    DaemonRestarted,
    Expired,
    K3Error,
    Mismatch,
    NotAttached,
    PermissionDenied,
    ProtocolMismatch,
    QuotaExceeded,
    ReadFailed,
    ShuttingDown,
    SlotsBusy,
    Starting,
    Timeout,
    UnknownExpert,
    Untrusted,
)
from .layout import TensorSpec
from .protocol import PROTOCOL_VERSION

__all__ = [
    "Client", "Expert", "connect", "TensorSpec", "PROTOCOL_VERSION",
    "K3Error", "Mismatch", "BadRequest", "CacheFull", "DaemonNotRunning", "DaemonRestarted", "Expired",
    "NotAttached", "PermissionDenied", "ProtocolMismatch", "QuotaExceeded",
    "ReadFailed", "ShuttingDown", "SlotsBusy", "Starting", "Timeout", "UnknownExpert", "Untrusted",
]
