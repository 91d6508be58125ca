"""Source file identity: a local checkpoint file changed while served is noticed, never mixed in.

A file's identity is ``(st_dev, st_ino, st_size, st_mtime_ns)``, recorded from the
served descriptor (``fstat``) as the source opens its files (``open_source`` calls
``record``: before the arena is built, which may take minutes); the watch, made
when the server starts, checks each file at once, so a change during start-up is
caught too.

Two checks against the recorded identity:
- ``fstat`` of the served descriptor, after every batch of reads (``check(files,
  paths=False)``, the files of the loads that just finished): a write in place (``cp
  other shard`` truncates and rewrites the inode the daemon reads) moves size or
  mtime.  This is the check a read's bytes depend on;
- ``stat`` of the path as well, once a second (``due``) and when the watch is made: a
  replaced file (``mv new shard``, a re-download) is another inode and a removed one
  is missing.  The descriptor still reads the old inode, whole and unchanged, so
  until the next ``due`` (at most ~1 s) reads serve the old bytes, never a mix.
A file found changed stays changed (``changed``) until the daemon restarts, and is
logged once, at ERROR, in the one line ``message`` gives.

Why a read checked *after* it ends cannot be a mix: the kernel updates mtime before
it copies a write's bytes into the page cache, and the identity compared against is
the one recorded at start, so any write that reached a byte a read returned is seen
by a check made after that read returned.  A write that starts after the check
reached no byte of the read.  Hence the server (``k3d.cache.fetch``) checks the files
of every finished load after its last part reported and before its slot goes READY.
Limits: a write inside the very clock tick (a few ms on coarse-timestamp kernels) in
which the file was last written before the daemon opened it, with the size kept, is
not seen; nor is a write through a shared mapping until the kernel updates mtime.

Cost, on the server thread: one ``fstat`` per file per batch of finished reads (a
batch: the loads one ``apply_done`` pass finishes; ~6 µs measured on this project's
2-core AMD EPYC VM, against ~200 µs for one warm 1 MiB pread), and an ``fstat`` plus a
``stat`` of every file once a second (~20 µs per file there).

Remote sources (HTTP, S3) have no descriptor here: they pin each origin file's ETag
(or size + Last-Modified) at start and send it with every range request, so a changed
origin fails the read ("origin changed") instead (``k3d.sources.remote``).

Thread: the server thread only (``check``, ``due``); no locking.
"""

from __future__ import annotations

import logging
import os
from typing import NamedTuple

log = logging.getLogger("k3d")

EVERY_S = 1.0            # seconds between checks of every file (``due``)


class Identity(NamedTuple):
    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> Identity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def matches(self, st: os.stat_result) -> bool:
        """``Identity.of(st) == self``, without making the tuple (every batch of reads asks)."""
        return (st.st_mtime_ns == self.mtime_ns and st.st_size == self.size
                and st.st_ino == self.ino and st.st_dev == self.dev)


def difference(was: Identity, now: Identity) -> str | None:
    """What changed from ``was`` to ``now``, in words (None: the same file, unchanged)."""
    if (was.dev, was.ino) != (now.dev, now.ino):
        return f"replaced: inode {was.ino} -> {now.ino}"
    if was.size != now.size:
        return f"size {was.size} -> {now.size} bytes"
    if was.mtime_ns != now.mtime_ns:
        return f"mtime {was.mtime_ns / 1e9:.3f} -> {now.mtime_ns / 1e9:.3f}"
    return None


def record(fds: list[int]) -> list[Identity]:
    """The identities of the files behind ``fds`` now (``open_source`` records them as it opens)."""
    return [Identity.of(os.fstat(fd)) for fd in fds]


def message(path: str, what: str) -> str:
    return (f"source file {path} changed while served ({what}); "
            "restart k3d to serve the new checkpoint")


class FileWatch:
    """The identities of a local source's files (``source.files`` / ``source.fds``)."""

    def __init__(self, paths: list[str], fds: list[int], ids: list[Identity] | None = None, now: float = 0.0):
        """``ids``: the identities recorded when the source opened the files (``record``);
        None: now.  A file already changed since is marked changed at once (and logged)."""
        self.paths = list(paths)
        self._abs = [os.path.abspath(p) for p in paths]
        self.fds = list(fds)
        self.ids: list[Identity] = list(ids) if ids is not None else record(self.fds)
        self.changed: dict[int, str] = {}        # file index -> its one-line message
        self.next_all = now + EVERY_S
        self.check(range(len(self.ids)))

    @classmethod
    def of(cls, source, now: float = 0.0) -> FileWatch | None:
        """A watch of ``source``'s local files; None for a source with no descriptors (remote)."""
        fds = getattr(source, "fds", None)
        if not fds or len(fds) != len(source.files):
            return None
        return cls(source.files, fds, getattr(source, "identities", None), now)

    def check(self, files, paths: bool = True) -> str | None:
        """Check each file index in ``files``; the first changed file's message (None: all
        unchanged).  ``paths=False``: the descriptors only (what a read's bytes depend on)."""
        first = None
        for i in files:
            msg = self.changed.get(i)
            if msg is None:
                msg = self._check(i, paths)
            if first is None:
                first = msg
        return first

    def _check(self, i: int, paths: bool) -> str | None:
        was = self.ids[i]
        st = os.fstat(self.fds[i])
        if not paths and was.matches(st):
            return None       # (the check after every batch of reads: unchanged, nothing made)
        what = difference(was, Identity.of(st))
        if what is None and paths:
            try:
                what = difference(was, Identity.of(os.stat(self._abs[i])))
            except FileNotFoundError:
                what = "removed"
            except OSError as e:
                what = f"cannot stat: {e.strerror}"
        if what is None:
            return None
        msg = self.changed[i] = message(self.paths[i], what)
        log.error("%s; experts already resident stay (read whole before the change), "
                  "fetches that need a read from it fail", msg)
        return msg

    def due(self, now: float) -> None:
        """Once a second: every file, descriptor and path, so a replaced file is noticed and
        any change is logged without a read."""
        if now >= self.next_all:
            self.next_all = now + EVERY_S
            self.check(range(len(self.ids)))
