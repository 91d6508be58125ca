"""k3client: the light client of the k3d expert cache (numpy, pyzmq, msgpack)."""

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
from .protocol import PROTOCOL_VERSION

__all__ = [
    "Client", "Expert", "connect", "TensorSpec", "PROTOCOL_VERSION",
    "K3Error", "Mismatch", "BadRequest", "CacheFull", "DaemonNotRunning", "DaemonRestarted", "Expired",
    "NotAttached", "PermissionDenied", "ProtocolMismatch", "QuotaExceeded",
    "ReadFailed", "ShuttingDown", "SlotsBusy", "Starting", "Timeout", "UnknownExpert", "Untrusted",
]


# Loaded on first use (PEP 562): ``import k3client.endpoint`` (``k3ctl status``, a
# short-lived process) must not pay for numpy and the client (~50 ms).
_LAZY = {"Client": "client", "Expert": "client", "connect": "client", "TensorSpec": "layout"}


def __getattr__(name):
    import importlib
    try:
        module = importlib.import_module(f".{_LAZY.get(name, name)}", __name__)
    except ModuleNotFoundError as e:     # neither a lazy name nor a submodule
        if e.name != f"{__name__}.{_LAZY.get(name, name)}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    if name not in _LAZY:
        return module                    # a submodule not imported yet: ``k3client.views``
    value = globals()[name] = getattr(module, name)
    return value


def __dir__():
    return sorted([*globals(), *_LAZY])
