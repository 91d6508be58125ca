"""The tiers under a remote source's ``read``: disk entry or origin, crc check, write-behind.

A load is one expert being read into one slot, possibly in several parts on
several reader threads (``k3d.reads.plan.split_extents``).  A load's parts are
tracked by the slot memoryview object the server makes per load (as in
packed.py): a part that brings another object starts a new load of that
expert, so parts of an earlier, failed load are never mixed in.

The first part of a load decides where the expert comes from: a valid disk
entry (``DiskCache.lookup``: same origin, fingerprint and validators) -> disk,
else the origin.  Per load:

- disk parts are pread from the entry file (one pread per run of extents that
  only the padding between two layout tensors separates) and crc'ed;
- origin parts are fetched (``fetch_into``: one checked, retried ranged
  request per file-contiguous run) and crc'ed when the load wants a check (a
  disk entry, or a packed origin's crc32 per expert);
- an unreadable entry (gone, EIO) is dropped and that part comes from the
  origin (``fallback``); the whole load is still checked against the entry's crc;
- when the last part lands (``Load.got`` = the expert's payload bytes), the
  parts must tile the expert's extents exactly, their crcs are combined
  (``crc32_of_parts``) and compared: a disk mismatch drops the entry and
  refetches the whole expert from the origin in that thread; a packed
  origin's mismatch fails the load.  A torn entry is never served.

Write-behind: after an origin (or fallback) load completes, the slot image
(tensors at their layout offsets, gaps zero) is copied, because the slot may
be evicted as soon as ``read`` returns, and queued to one writer thread
(``k3d-disk-writer``) that inserts it (tmp + fsync + rename, in disk_cache.py).
If more than ``WRITE_BACKLOG`` bytes wait, the copy is skipped (counted), so
a slow disk never slows fetches.

Thread-safety: ``read`` runs on many reader threads.  ``Tiers._mu`` guards the
pending-load table and the write backlog; ``Counters`` has its own lock; the
two are never held together, and no I/O happens under either.  The disk
cache index has its own lock (taken without ``_mu`` held).  The fingerprint
memo is filled idempotently (a racing duplicate computes the same string).
Built on the main thread; ``close`` (main thread, after the readers stopped)
drains the writer.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import threading
import time

from k3client.layout import layout_bytes

from ..base import Extent, SourceError, contiguous_runs
from ..checksum import crc32, crc32_of_parts
from .disk_cache import DATA_OFFSET, DiskCache, Entry
from .headers import Catalog

log = logging.getLogger("k3d")

WRITE_BACKLOG = 512 << 20     # bytes of slot images waiting for the disk writer


class Counters:
    """A remote source's tier counters (``tier_stats``), safe to bump from any thread."""

    NAMES = ("disk_hits", "disk_corrupt", "disk_write_skipped", "disk_write_errors", "origin_fetches",
             "origin_bytes", "origin_seconds", "requests", "retries", "errors")

    def __init__(self):
        self._mu = threading.Lock()
        self._c = dict.fromkeys(self.NAMES, 0)
        self._c["origin_seconds"] = 0.0

    def add(self, name: str, n=1) -> None:
        with self._mu:
            self._c[name] += n

    def snapshot(self) -> dict:
        with self._mu:
            return dict(self._c)


class Load:
    """One expert load in progress: its parts' (slot_offset, length, crc) and where they came from."""
    __slots__ = ("entry", "fallback", "got", "parts", "token")

    def __init__(self, token: memoryview, entry: Entry | None):
        self.token, self.parts, self.got, self.entry = token, [], 0, entry
        self.fallback = False     # a part of it came from the origin: its disk entry was unreadable


class Tiers:
    """Reads of one remote source's experts through its disk tier (if any) and its origin."""

    def __init__(self, path: str, catalog: Catalog, files: list[str], validators: list[dict],
                 cache: DiskCache | None, fetch_into, counters: Counters):
        self.path, self.catalog, self.cache, self.counters = path, catalog, cache, counters
        self._files, self._validators = files, validators
        self._fetch_into = fetch_into          # (file, offset, bufs) -> bytes: one checked, retried range
        self._payload = {k: sum(e.length for e in ex) for k, ex in catalog.keys.items()}
        self._expert_bytes = max(layout_bytes(lay) for lay in [catalog.layout, *catalog.layouts.values()])
        # per layer: {end of a layout tensor: start of the next one} (the gap between is padding only)
        self._pads = {layer: self._padding(catalog.layout_of(layer)) for layer in {k[0] for k in catalog.keys}}
        self._fp: dict = {}
        self._mu = threading.Lock()
        self._pending: dict[tuple[int, int], Load] = {}
        self._backlog = 0
        self._wq: queue.Queue = queue.Queue()
        self._writer = None
        if cache is not None:
            self._writer = threading.Thread(target=self._write_loop, name="k3d-disk-writer", daemon=True)
            self._writer.start()

    @staticmethod
    def _padding(layout) -> dict[int, int]:
        specs = sorted(layout, key=lambda s: s.offset)
        return {a.offset + a.nbytes: b.offset for a, b in itertools.pairwise(specs)}

    # -- disk identity ---------------------------------------------------------------------------
    def fingerprint(self, key) -> str:
        fp = self._fp.get(key)
        if fp is None:
            desc = [[s.name, s.dtype, list(s.shape), s.offset, s.nbytes] for s in self.catalog.layout_of(key[0])]
            ex = [[self._files[e.file], e.offset, e.slot_offset, e.length] for e in self.catalog.keys[key]]
            fp = crc32(json.dumps([self.catalog.format, desc, ex]).encode()).to_bytes(4, "big").hex()
            self._fp[key] = fp
        return fp

    def _validators_of(self, key) -> dict:
        return {self._files[fi]: self._validators[fi] for fi in sorted({e.file for e in self.catalog.keys[key]})}

    # -- reading -------------------------------------------------------------------------------
    def read(self, key, extents: list[Extent], slot: memoryview) -> int:
        """One part of ``key``'s load into ``slot``; the part that completes it verifies it."""
        n = sum(e.length for e in extents)
        load = self._begin(key, slot)
        try:
            pieces = self._read_part(load, key, extents, slot)
        except BaseException:
            with self._mu:
                if self._pending.get(key) is load:
                    del self._pending[key]
            raise
        with self._mu:
            if self._pending.get(key) is not load:
                return n            # load abandoned (a sibling part failed)
            if pieces is not None:
                load.parts.extend(pieces)
            load.got += n
            if load.got < self._payload[key]:
                return n
            del self._pending[key]
        self._finish(load, key, slot)
        return n

    def _begin(self, key, slot) -> Load:
        with self._mu:
            load = self._pending.get(key)
            if load is not None and load.token is slot:
                return load
        entry = None
        if self.cache is not None:
            entry = self.cache.lookup(self.path, key, self.fingerprint(key), self._validators_of(key))
        with self._mu:
            load = self._pending.get(key)
            if load is None or load.token is not slot:
                # a new load of this expert: an earlier (failed) load's parts are forgotten
                load = Load(slot, entry)
                self._pending[key] = load
            return load

    def _want_crc(self, load: Load, key) -> bool:
        return load.entry is not None or key in self.catalog.expected_crc

    def _read_part(self, load: Load, key, extents, slot) -> list | None:
        if load.entry is not None:
            try:
                return self._disk_part(load, key, extents, slot)
            except OSError as e:
                # gone or unreadable (deleted under the daemon, EIO): the index forgets it and
                # this part comes from the origin; the whole load is still checked against the
                # entry's crc (other parts may have come from disk) and then written back
                log.warning("disk cache entry of expert (layer %d, expert %d) unreadable (%s): "
                            "dropped, reading from %s", key[0], key[1], e, self.path)
                self.cache.discard(self.path, key)
                with self._mu:
                    load.fallback = True
                self.counters.add("disk_corrupt")
        self._origin_read(extents, slot)
        if self._want_crc(load, key):
            return [(e.slot_offset, e.length, crc32(slot[e.slot_offset:e.slot_offset + e.length]))
                    for e in extents]
        return None

    def _disk_part(self, load: Load, key, extents, slot) -> list:
        """Read a part from its disk entry; its crcs are checked against the entry's once
        the load is whole (also when another part fell back to the origin)."""
        fd = os.open(load.entry.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)   # a FIFO must not block
        try:
            # the entry is the slot image: one pread per run of extents separated only by
            # the padding between two layout tensors (one ends, the next begins), so a run
            # writes no byte that another part of the load owns
            runs: list[list[int]] = []
            pad = self._pads[key[0]]
            for e in sorted(extents, key=lambda x: x.slot_offset):
                if runs and (runs[-1][1] == e.slot_offset or pad.get(runs[-1][1]) == e.slot_offset):
                    runs[-1][1] = e.slot_offset + e.length
                else:
                    runs.append([e.slot_offset, e.slot_offset + e.length])
            for lo, hi in runs:
                got = 0
                while got < hi - lo:
                    n = os.preadv(fd, [slot[lo + got:hi]], DATA_OFFSET + lo + got)
                    if n <= 0:
                        break      # a short entry: the crc check in _finish refetches
                    got += n
                # the arena is the cache: a second copy in the page cache only wastes RAM
                os.posix_fadvise(fd, DATA_OFFSET + lo, hi - lo, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return [(e.slot_offset, e.length, crc32(slot[e.slot_offset:e.slot_offset + e.length]))
                for e in extents]

    def _origin_read(self, extents, slot) -> int:
        t0 = time.perf_counter()
        total = 0
        for f, off, bufs in contiguous_runs(extents, slot, max_buffers=1 << 30):
            total += self._fetch_into(f, off, bufs)
        self.counters.add("origin_bytes", total)
        self.counters.add("origin_seconds", time.perf_counter() - t0)
        return total

    @staticmethod
    def _tiles(parts) -> list:
        """Merged (start, end) slot ranges of ``parts``; overlapping parts make it differ."""
        out = []
        for so, length, _ in sorted(parts):
            if out and out[-1][1] == so:
                out[-1][1] = so + length
            else:
                out.append([so, so + length])
        return out

    def _finish(self, load: Load, key, slot) -> None:
        """The last part of ``key`` landed: verify, count, and write through to disk."""
        from_disk = load.entry is not None
        expected = self.catalog.expected_crc
        if self._want_crc(load, key):
            ext = self.catalog.keys[key]
            if self._tiles(load.parts) != self._tiles([(e.slot_offset, e.length, 0) for e in ext]):
                raise SourceError(f"internal: the parts read of expert {key} do not tile it exactly")
            crc = crc32_of_parts(load.parts)
            if from_disk and crc != load.entry.crc32:
                log.warning("disk cache entry of expert (layer %d, expert %d) fails its crc32 "
                            "(%08x, entry says %08x): dropped, refetching from %s",
                            key[0], key[1], crc, load.entry.crc32, self.path)
                self.cache.discard(self.path, key)
                self.counters.add("disk_corrupt")
                self._origin_read(ext, slot)
                from_disk = False
                crc = self._payload_crc(slot, key) if key in expected else None
            want = expected.get(key)
            if not from_disk and want is not None and crc != want:
                self.counters.add("errors")
                raise SourceError(f"checksum mismatch in expert (layer {key[0]}, expert {key[1]}) of "
                                  f"{self.path}: crc32 {crc:08x}, header says {want:08x}")
        if load.fallback:
            from_disk = False       # verified, but (some of) it came from the origin: write it again
        self.counters.add("disk_hits" if from_disk else "origin_fetches")
        if not from_disk and self.cache is not None:
            self._write_behind(key, slot)

    def _payload_crc(self, slot, key) -> int:
        crc = 0
        for e in sorted(self.catalog.keys[key], key=lambda x: x.slot_offset):
            crc = crc32(slot[e.slot_offset:e.slot_offset + e.length], crc)
        return crc

    # -- write-behind to the disk tier -----------------------------------------------------------
    def _write_behind(self, key, slot) -> None:
        n = self._expert_bytes
        with self._mu:
            skip = self._backlog + n > WRITE_BACKLOG
            if not skip:
                self._backlog += n
        if skip:
            self.counters.add("disk_write_skipped")
            return
        image = bytearray(n)      # zero gaps; the copy frees the slot for eviction right away
        for e in self.catalog.keys[key]:
            image[e.slot_offset:e.slot_offset + e.length] = slot[e.slot_offset:e.slot_offset + e.length]
        self._wq.put((key, image))

    def _write_loop(self) -> None:
        while True:
            item = self._wq.get()
            if item is None:
                return
            key, image = item
            try:
                crc = self._payload_crc(memoryview(image), key)
                self.cache.insert(self.path, key, self.fingerprint(key), self._validators_of(key), image, crc)
            except OSError as e:
                log.warning("disk cache: cannot write expert (layer %d, expert %d): %s", key[0], key[1], e)
                self.counters.add("disk_write_errors")
            finally:
                with self._mu:
                    self._backlog -= len(image)
                self._wq.task_done()

    def flush(self, timeout: float = 60.0) -> None:
        """Wait (at most ``timeout`` s) until queued disk writes are done (``close`` drains so)."""
        deadline = time.monotonic() + timeout
        while self._writer is not None and time.monotonic() < deadline:
            with self._mu:
                if self._backlog == 0 and self._wq.unfinished_tasks == 0:
                    return
            time.sleep(0.005)

    def backlog(self) -> int:
        with self._mu:
            return self._backlog

    def close(self) -> None:
        """Main thread, after the readers stopped: drain the writer, release the cache."""
        if self._writer is not None:
            self.flush(timeout=30)
            self._wq.put(None)
            self._writer.join(timeout=30)
            self._writer = None
        if self.cache is not None:
            self.cache.close()
        with self._mu:
            self._pending = {}
