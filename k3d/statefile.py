"""One JSON document in the daemon's state directory, written so a crash leaves the old or the new.

Used by the warm-restart state (``k3d.cache.warm``) and the content-digest cache
(``k3d.sources.digest``); a top-level module so that both packages import it
without one importing the other.

The write: a temporary file in the same directory (``prefix``...``.tmp``, created
0600 by ``mkstemp``), the document, optionally ``fsync``, ``os.replace`` over the
target, then (with ``durable``) an ``fsync`` of the directory so the rename itself
survives a power loss.  Any failure unlinks the temporary file and raises (the
caller logs it); readers see either the previous file or the new one, never a
part.  ``prune`` functions in the callers remove temporary files a killed writer
left (they match ``prefix``/``.tmp``).

Caller's obligations: one writer per path at a time (the server thread).
"""

from __future__ import annotations

import json
import os
import tempfile


def write_json(path: str, doc: dict, prefix: str, durable: bool = False, default=None) -> None:
    """Write ``doc`` to ``path`` atomically (module docstring); ``durable``: fsync file and directory."""
    d = os.path.dirname(path)
    os.makedirs(d, mode=0o700, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, separators=(",", ":"), default=default)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if durable:
        try:                                   # the rename itself survives a crash
            dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError:
            pass
