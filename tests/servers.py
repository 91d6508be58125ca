"""The real server loop in this process, on an ipc socket: what component tests run.

``Servers(checkpoint)`` starts ``k3d.serve.loop.Server`` loops in daemon threads, each
on its own scratch directory (or a given endpoint, to replace a daemon in place),
over a real arena and a real source (``source_cls``: ``SafetensorsSource`` or a
test's subclass that delays or fails reads).  ``start(**cfg)`` takes the daemon's
config keys (``slots``, ``readers``, ``lease_s``, ...) and returns the ``Server``
with ``ref`` (the ``safetensors.safe_open`` reference) and ``thread`` set;
``close()`` stops every loop (the last started first), then closes its arena and source.  ``state_dir`` is
``none`` unless given: these servers test the loop, not warm restarts, so no state
file is left behind.  The ``pytest`` fixtures (``server`` in component modules)
wrap it so every started server is stopped after the test, passed or failed.
"""

from __future__ import annotations

import tempfile
import threading

from conftest import SCRATCH
from helpers import reference as reference_reader
from k3d.config import DEFAULT_PATTERN, resolve
from k3d.memory.arena import Arena
from k3d.serve.loop import Server
from k3d.service.daemon import size_arena
from k3d.sources.safetensors import SafetensorsSource


class Servers:
    def __init__(self, checkpoint: str, source_cls=SafetensorsSource, prefix: str = "k3d-c-"):
        self.checkpoint, self.source_cls, self.prefix = checkpoint, source_cls, prefix
        self.ref = reference_reader(checkpoint)
        self.started: list[tuple] = []

    def start(self, endpoint: str | None = None, slots: int = 16, readers: int = 2, source=None, **cfg_kw) -> Server:
        """A loop serving ``source`` (default: a new ``source_cls`` on the checkpoint) on ``endpoint``."""
        if endpoint is None:
            endpoint = f"ipc://{tempfile.mkdtemp(prefix=self.prefix, dir=SCRATCH)}/k.sock"
        cfg_kw.setdefault("state_dir", "none")
        cfg = resolve({"endpoint": endpoint, "slots": slots, "readers": readers, **cfg_kw}, {})
        src = source if source is not None else self.source_cls(self.checkpoint, DEFAULT_PATTERN)
        arena = Arena(*size_arena(cfg, src.expert_bytes))
        srv = Server(cfg, src, arena, f"{endpoint.removeprefix('ipc://')}.arena")
        srv.ref = self.ref
        srv.thread = threading.Thread(target=srv.serve_forever, daemon=True)
        srv.thread.start()
        self.started.append((srv, arena, src))
        return srv

    def close(self) -> None:
        """Stop in reverse order: a replaced daemon's stop (which unlinks the endpoint) comes last."""
        for srv, arena, src in reversed(self.started):
            srv.request_stop()
            srv.thread.join(10)
            arena.close()
            src.close()
        self.started.clear()
