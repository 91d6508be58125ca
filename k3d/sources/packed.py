"""The reader of packed files (``.k3pack``): every expert at a fixed stride, one read per expert.

The format (file layout, header, ``read_header``'s validation) is packformat.py;
packwrite.py writes packs; ``k3d pack`` is k3d/commands/pack.py.  Experts lie
4096-aligned at ``data_offset + i * stride``, each tensor at its slot-layout
offset, so one read of ``stride`` bytes fills a slot with no scatter.

Invariants:
- Read-time verification: an expert (or part) is read ``CHUNK`` bytes at a
  time; each piece, as it lands, goes to the reader thread's ``CrcPipeline``
  companion, which folds it into the running crc32 while the reader already
  reads the next piece.  The crc32 of every expert
  is checked once all its bytes are in the slot; a mismatch raises
  ``ChecksumError`` naming the expert, so the daemon fails that load and
  never serves it.  The server may split one
  expert into page-aligned parts read by several threads: each part's crc is
  recorded and the part that completes the expert combines them
  (``crc32_of_parts``) and checks.  Parts of one load share one slot
  memoryview object (the server makes one per load); that object identifies
  the load, so parts of an earlier, failed load of the same expert are never
  mixed in.

Read modes: ``buffered`` preads through the page cache and then drops what it
read (``POSIX_FADV_DONTNEED``: the arena is the cache; a second copy in the page
cache only wastes RAM), with readahead off (``POSIX_FADV_RANDOM``: pages read
ahead would stay cached after their expert's drop; the header is read the same
way, because a readahead window leaves a mark whose later hit starts async
readahead even on a RANDOM descriptor); ``direct`` preads from an O_DIRECT
descriptor, so misses bypass the page cache entirely.  A piece that is not 4096-aligned (offset,
length or slot address) is read through the buffered descriptor instead, so
direct mode never fails on alignment.

Thread: a ``PackedSource`` is built on the main thread (``read_header`` runs
there) and its header, layout and keys are read-only after.
``PackedSource.read`` is called by many reader threads at once;
the pending-part table and the list of checksum companions (one per reader
thread, made on its first read, ended by ``close()``) are the only shared
mutable state and share one lock.  A companion reads only the pieces its
reader fed it, and has let go of them before ``read`` returns or raises.
Caller's obligation: ``close()`` runs once no read is running (the reader pool
has stopped); a read after it raises ``SourceError``.
"""

from __future__ import annotations

import ctypes
import os
import threading

from .base import PAGE, Extent, Source, SourceError, read_fully
from .checksum import CrcPipeline, crc32_of_parts
from .packformat import MAGIC as MAGIC, read_header  # MAGIC: where tests and callers have taken it from

READ_MODES = ("buffered", "direct")
# Bytes per read request (and checksummed piece): more, smaller requests in flight
# read a cold disk faster than fewer large ones, and a small piece keeps the checksum
# left after its last read short (bench/README.md, "request size").
CHUNK = 1 << 20


class ChecksumError(SourceError):
    """An expert's bytes do not match the checksum in the packed header."""


# -- reading ------------------------------------------------------------------------------
def _address(mv: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mv))


class PackedSource(Source):
    kind = "packed"

    def __init__(self, path: str, read_mode: str = "buffered"):
        super().__init__()
        if read_mode not in READ_MODES:
            raise SourceError(f"unknown read mode {read_mode!r} (use buffered or direct)")
        self.path, self.read_mode = path, read_mode
        h, _ = read_header(path)
        self.header = {k: v for k, v in h.items() if not k.startswith("_")}
        self.layout = h["_layout"]
        self.layouts = h["_layouts"]
        self.tensor_format = h["tensor_format"]
        self.tensor_types = h.get("tensor_types") or {}
        for layers, _, types in h.get("layouts") or []:
            for layer in layers:
                self.layer_tensor_types[layer] = types
        fam = h.get("family")
        self.family_fields = ({k: fam.get(k) for k in ("family", "family_rule", "top_k")}
                              if isinstance(fam, dict) else {})
        self.stride, self.data_offset = h["stride"], h["data_offset"]
        self._crcs = h["_crcs"]
        self._names = h["_keys"]
        for i, key in enumerate(self._names):
            self.keys[key] = [Extent(0, self.data_offset + i * self.stride, 0, self.stride)]
        self.files = [path]
        self.fds = [os.open(path, os.O_RDONLY | os.O_CLOEXEC)]
        # no readahead: experts are wanted in routing order, not file order, and pages the
        # kernel read ahead would land in the page cache after their expert's DONTNEED
        os.posix_fadvise(self.fds[0], 0, 0, os.POSIX_FADV_RANDOM)
        self._dfd = None
        if read_mode == "direct":
            try:
                self._dfd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
            except OSError as e:
                self.close()
                raise SourceError(f"{path}: --read-mode direct: this file system refuses O_DIRECT "
                                  f"({e.strerror}); use --read-mode buffered") from None
        self._lock = threading.Lock()
        # expert index -> (load token, [(start, length, crc)]); see the module docstring
        self._pending: dict[int, tuple[object, list]] = {}
        self._local = threading.local()            # .crcs: this reader thread's CrcPipeline
        self._pipelines: list[CrcPipeline] = []    # every companion, ended by close()
        self._closed = False

    def describe(self) -> dict:
        d = super().describe()
        d["read_mode"] = self.read_mode
        d["packed_from"] = self.header.get("source", {}).get("kind")
        if self.tensor_types:
            d["tensor_types"] = dict(self.tensor_types)
        return d

    def read(self, extents: list[Extent], slot: memoryview) -> int:
        crcs = self._pipeline()
        total = 0
        for e in extents:
            dest = slot[e.slot_offset:e.slot_offset + e.length]
            # Piece by piece: this thread's companion checksums piece k while this
            # thread already waits on piece k+1, so the next request is never held
            # back by a checksum (in line, that cost a cold batch ~6 %).
            # The common case, checked once per extent: file offset, length, slot memory
            # and CHUNK all 4096-aligned, so every piece is one plain O_DIRECT pread.
            aligned = (self._dfd is not None and e.length and not (e.offset | e.length | CHUNK) % PAGE
                       and not (_address(dest) - e.offset) % PAGE)
            try:
                for pos in range(0, e.length, CHUNK):
                    piece = dest[pos:pos + CHUNK]
                    if aligned:
                        n = os.preadv(self._dfd, [piece], e.offset + pos)
                        if n != len(piece):     # short: the rest, as _read_direct can (EOF: an error)
                            self._read_direct(e.offset + pos + n, piece[n:])
                    elif self._dfd is not None:
                        self._read_direct(e.offset + pos, piece)
                    else:
                        read_fully(self.fds[0], [piece], e.offset + pos, self.path)
                        os.posix_fadvise(self.fds[0], e.offset + pos, len(piece), os.POSIX_FADV_DONTNEED)
                    crcs.feed(piece)
            finally:
                # also on a failed read: the companion must let go of slot memory
                # before the slot can be handed on
                crc = crcs.finish()
            total += e.length
            self._verify(e, crc, slot)
        return total

    def _pipeline(self) -> CrcPipeline:
        """The calling reader thread's checksum companion (made on its first read)."""
        if self._closed:
            raise SourceError(f"{self.path}: read after close")
        crcs = getattr(self._local, "crcs", None)
        if crcs is None:
            with self._lock:
                if self._closed:
                    raise SourceError(f"{self.path}: read after close")
                crcs = self._local.crcs = CrcPipeline(f"k3d-crc-{threading.current_thread().name}")
                self._pipelines.append(crcs)
        return crcs

    def _read_direct(self, offset: int, dest: memoryview) -> None:
        """O_DIRECT for the 4096-aligned middle; the unaligned head/tail (if any) buffered."""
        n = len(dest)
        addr = _address(dest)
        if (addr - offset) % PAGE:
            # file and memory alignment differ: O_DIRECT cannot serve any of it
            read_fully(self.fds[0], [dest], offset, self.path)
            return
        head = -offset % PAGE
        mid = max(0, (n - head) // PAGE * PAGE)
        if head:
            read_fully(self.fds[0], [dest[:min(head, n)]], offset, self.path)
        if mid:
            read_fully(self._dfd, [dest[head:head + mid]], offset + head, self.path)
        if head + mid < n:
            read_fully(self.fds[0], [dest[head + mid:]], offset + head + mid, self.path)

    def _expert(self, offset: int) -> tuple[int, int]:
        rel = offset - self.data_offset
        return rel // self.stride, rel % self.stride

    def _verify(self, e: Extent, crc: int, slot: memoryview) -> None:
        """Check ``crc`` (of extent ``e``) or, for a part, keep it until the expert's parts are in."""
        i, start = self._expert(e.offset)
        if start == 0 and e.length == self.stride:
            return self._check(i, crc)
        with self._lock:
            token, parts = self._pending.get(i, (None, None))
            if token is not slot:
                # a new load of this expert: forget any earlier (failed) load's parts
                token, parts = slot, []
                self._pending[i] = (token, parts)
            parts.append((start, e.length, crc))
            if sum(p[1] for p in parts) < self.stride:
                return
            del self._pending[i]
        parts.sort()
        pos = 0
        for s, length, _ in parts:
            if s != pos:
                raise ChecksumError(f"expert {self._names[i]}: parts read overlap or leave a hole at {pos}")
            pos += length
        self._check(i, crc32_of_parts(parts))

    def _check(self, i: int, crc: int) -> None:
        if crc != self._crcs[i]:
            l, e = self._names[i]
            raise ChecksumError(f"checksum mismatch in expert (layer {l}, expert {e}) of {self.path}: "
                                f"crc32 {crc:08x}, header says {self._crcs[i]:08x}; the file is corrupt, repack it")

    def close(self):
        """Caller's obligation: no read is running (the reader pool has stopped)."""
        if hasattr(self, "_pipelines"):
            with self._lock:
                self._closed = True
                pipelines, self._pipelines = self._pipelines, []
            for p in pipelines:
                p.close()
        if getattr(self, "_dfd", None) is not None:
            os.close(self._dfd)
            self._dfd = None
        self._pending = {}
        super().close()
