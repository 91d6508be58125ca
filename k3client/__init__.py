"""k3client: the light client of the k3d expert cache (numpy, pyzmq, msgpack)."""

# The names below are loaded on first use (PEP 562): ``import k3client.endpoint`` (k3ctl
# status, a short-lived process) must not pay for numpy and the client (~50 ms).
_LAZY = {"Client": "client", "Expert": "client", "connect": "client", "TensorSpec": "layout",
         "PROTOCOL_VERSION": "protocol"}
_ERRORS = ("K3Error", "Mismatch", "BadRequest", "CacheFull", "DaemonNotRunning", "DaemonRestarted",
           "NotAttached", "PermissionDenied", "ProtocolMismatch", "QuotaExceeded", "ReadFailed",
           "ShuttingDown", "SlotsBusy", "Starting", "Timeout", "UnknownExpert", "Untrusted")


def __getattr__(name):
    import importlib
    module = _LAZY.get(name) or ("errors" if name in _ERRORS else None)
    if module is None:       # a submodule not imported yet (``k3client.errors.X`` after ``import k3client``)
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'k3client' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value          # the next use is a plain attribute
    return value


def __dir__():
    return sorted([*globals(), *_LAZY, *_ERRORS])


__all__ = [
    "Client", "Expert", "connect", "TensorSpec", "PROTOCOL_VERSION",
    "K3Error", "Mismatch", "BadRequest", "CacheFull", "DaemonNotRunning", "DaemonRestarted",
    "NotAttached", "PermissionDenied", "ProtocolMismatch", "QuotaExceeded",
    "ReadFailed", "ShuttingDown", "SlotsBusy", "Starting", "Timeout", "UnknownExpert", "Untrusted",
]
