"""Inline reads: a small expert already in the page cache is copied on the server thread.

Handing a read to a reader thread costs more than the read when the expert is
small and cached: a condition-variable wake-up per job, the reader taking the
GIL from the server thread, its report, an eventfd wake-up and a second loop
pass that parks and then answers the fetch.  For a 14 KB expert the copy itself
is a few microseconds.  So ``Loads.start`` offers its keys here first
(``read_all``: one call per start, not one per key); what is read here is
finished when it returns, never a ``Load`` nor a report: the slots go to
``Loads.inline`` (``InlineDone``), which the caller takes and completes in one
pass (``FetchService._finish_inline``).

What may be read inline (everything else goes to the pool, unchanged):
- a local source whose ``read`` is ``Source.read`` as ``k3d.sources.base``
  defines it (buffered ``preadv``: safetensors, GGUF); never an O_DIRECT pack,
  a remote origin, or a read wrapped at run time;
- an expert of at most ``max_bytes``, within ``budget`` bytes per call (a fetch
  of many keys, or a warm restart, cannot hold the loop for long);
- only while every byte is in the page cache: each ``preadv`` has
  ``RWF_NOWAIT``, so a page not cached ends the attempt at once (EAGAIN) and
  the key goes to the pool, which waits for the disk off the loop.  Any other
  failure (a short file, EIO) also goes to the pool: its report is the one
  every error takes, with the message users know.

A partial attempt leaves bytes in the slot; the pool's read overwrites them
all before the slot is READY, so nothing of it is ever seen.

Per key the cost is a dict look-up of its runs (``runs_of``, made once per key)
and one ``preadv`` per run into a slice of the slot; a short count (a page not
cached part-way) finishes through ``base.read_fully``, the one pread loop.  While
``base.read_fully`` is not the stock one (a test's fault injection replaced it),
every run goes through it, looked up at each call, as the pool's reads do.

Thread: the server thread only (``Loads`` calls it); no state but counters and
the runs cache.
"""

from __future__ import annotations

import os
import time

from ..sources import base
from ..sources.base import Source

MAX_BYTES = 256 << 10       # an expert above this goes to the pool (a copy of ~50 us or more)
BUDGET = 1 << 20            # bytes read inline per start call at most
NOWAIT = getattr(os, "RWF_NOWAIT", 0)


def can_inline(source) -> bool:
    """Whether ``source`` reads with the stock buffered ``preadv`` of ``k3d.sources.base``
    (what ``read`` here does).  Named, not compared by identity: a read replaced or
    wrapped at run time (a test's fault injection, a subclass) keeps its reads in the pool."""
    read = type(source).read
    return (bool(NOWAIT) and bool(getattr(source, "fds", None))
            and (getattr(read, "__module__", None), getattr(read, "__qualname__", None))
            == (Source.__module__, "Source.read"))


def stock(read_fully) -> bool:
    """Whether ``read_fully`` is ``k3d.sources.base``'s own (named, not compared by identity:
    one replaced before this module was imported is still told apart)."""
    return (getattr(read_fully, "__module__", None), getattr(read_fully, "__qualname__", None)) \
        == (base.__name__, "read_fully")


class InlineDone:
    """What inline reads finished since the caller last took them: ``slots`` and their
    ``keys`` (same order), the bytes and the seconds the copies took."""

    __slots__ = ("keys", "nbytes", "seconds", "slots")

    def __init__(self) -> None:
        self.slots: list[int] = []
        self.keys: list[tuple[int, int]] = []
        self.nbytes = 0
        self.seconds = 0.0


class InlineReads:
    def __init__(self, source, max_bytes: int = MAX_BYTES, budget: int = BUDGET) -> None:
        self.source = source
        self.max_bytes = max_bytes if can_inline(source) else 0      # 0: never inline
        self.budget = budget
        self.done = 0            # keys read inline
        self.declined = 0        # keys tried and handed to the pool (not cached, or an error)
        # key -> runs_of(its extents): one small tuple per key read inline, at most one
        # per expert of the model (~100 bytes each: 6 MB at 60,000 keys)
        self._runs: dict[tuple[int, int], tuple] = {}

    def read_all(self, slots_keys, view, out: InlineDone) -> list[tuple[int, tuple[int, int]]]:
        """Read each ``(slot, key)`` whose expert may be read here into ``view(slot)``,
        within one call's budget; the slots read join ``out``.  Returns the pairs left
        for the pool, in order."""
        if not self.max_bytes:
            return slots_keys
        rest = []
        left, cap, runs_by_key, keys_of = self.budget, self.max_bytes, self._runs, self.source.keys
        fds, preadv, read_fully = self.source.fds, os.preadv, base.read_fully
        direct = stock(read_fully)
        slots, keys, nbytes, declined = out.slots, out.keys, 0, 0
        t0 = time.perf_counter()
        for slot, key in slots_keys:
            runs = runs_by_key.get(key)
            if runs is None:
                runs = runs_by_key[key] = runs_of(keys_of[key])
            n = runs[0]
            if n > cap or n > left:
                rest.append((slot, key))
                continue
            dest = view(slot)
            try:
                for f, off, at, size in runs[1]:
                    buf = dest[at:at + size]
                    got = preadv(fds[f], [buf], off, NOWAIT) if direct else 0
                    if got != size:       # a short count: the one pread loop finishes or fails it
                        read_fully(fds[f], [buf[got:]], off + got, f"file #{f}", NOWAIT)
            except Exception:     # EAGAIN: not cached; anything else: the pool reads it and reports
                declined += 1
                rest.append((slot, key))
                continue
            left -= n
            nbytes += n
            slots.append(slot)
            keys.append(key)
        if nbytes:
            out.nbytes += nbytes
            out.seconds += time.perf_counter() - t0
        self.done += len(slots_keys) - len(rest)
        self.declined += declined
        return rest


def runs_of(extents) -> tuple[int, list[tuple[int, int, int, int]]]:
    """(bytes, runs): ``extents`` merged where contiguous both in the file and in the slot,
    each run ``(file, offset, slot offset, length)``: one ``preadv`` of one buffer each
    (a synthetic or safetensors expert's tensors are usually one run)."""
    runs: list[list[int]] = []
    for e in sorted(extents, key=lambda x: (x.file, x.offset)):
        r = runs[-1] if runs else None
        if r is not None and r[0] == e.file and r[1] + r[3] == e.offset and r[2] + r[3] == e.slot_offset:
            r[3] += e.length
        else:
            runs.append([e.file, e.offset, e.slot_offset, e.length])
    return sum(r[3] for r in runs), [(r[0], r[1], r[2], r[3]) for r in runs]
