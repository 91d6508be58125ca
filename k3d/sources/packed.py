"""The packed format (``.k3pack``) and its reader: every expert at a fixed stride, one read per expert.

This module is the format (layout, ``read_header``'s validation) and the
reader (``PackedSource``); packwrite.py writes packs; ``k3d pack`` is k3d/commands/pack.py.

File layout (format versions 1 and 2)::

    offset 0        b"K3DPACK\\n"                        8-byte magic
    offset 8        u64 little-endian N                  JSON header length
    offset 16       N bytes of JSON header (UTF-8)
                    zero padding to data_offset          (a multiple of 4096)
    data_offset     expert keys[0]   span bytes, zero padding to stride
    + stride        expert keys[1]
    ...             expert keys[i] at data_offset + i * stride, i in (layer, expert) order
    file end        = data_offset + len(keys) * stride   (exactly: a short file is refused)

    header = {"format": "k3d-pack", "version": 1,
              "tensor_format": "raw" | "ggml:MXFP4" | ..., "tensor_types": {...} (optional),
              "source": {"kind": ..., "path": ...},
              "layout": [[name, dtype, shape, offset, nbytes], ...],   # as the wire TensorSpec
              "span": bytes of one expert (layout end), "stride": align(span, 4096),
              "data_offset": ..., "layers": [...], "experts": [...],
              "keys": [[layer, expert], ...], "checksum": "crc32",
              "checksums": ["%08x" of zlib.crc32 over the expert's stride bytes],
              "family": {"family", "family_rule", "top_k"} (optional: the source's family), ...}

Version 2 (written only when layers' layouts differ, e.g. a GGUF Q4_K_M mix) adds
``"layouts": [[[layers...], layout, {name: tensor type}], ...]`` giving every
layer's layout; ``layout`` is then the lowest layer's and ``span`` the largest
layout's bytes.  A layer whose layout is larger than ``span`` is refused by name.

Inside an expert's stride, tensors lie at their layout offsets (the slot
layout), so one read of ``stride`` bytes fills a slot with no scatter.

Invariants:
- Offsets and lengths of every expert are 4096-aligned, and so are arena slots,
  so ``--read-mode direct`` reads with O_DIRECT straight into slot memory.
- Atomic writes (packwrite.py): ``write_pack`` writes an unnamed ``O_TMPFILE`` in OUT's
  directory (data first, fsync, then the header, fsync) and links it in as
  ``OUT`` only when complete, so an interrupted pack leaves no file at all.
  Where the file system has no O_TMPFILE (and, over an existing OUT, for the
  instant before the rename) the file is ``OUT.partial``, which ``k3d start``
  refuses by name; its header stays zero bytes until the data is on disk, so
  a renamed one is refused too unless it is complete.
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
import json
import math
import os
import threading

from k3client.layout import DTYPES, TensorSpec, align, build_layout, layout_bytes

from .base import PAGE, Extent, Source, SourceError, read_fully
from .checksum import CrcPipeline, crc32_of_parts

MAGIC = b"K3DPACK\n"
FORMAT = "k3d-pack"
VERSION = 2                     # written when layers' layouts differ; uniform packs stay version 1
MAX_HEADER = 1 << 30
READ_MODES = ("buffered", "direct")
# Bytes per read request (and checksummed piece): more, smaller requests in flight
# read a cold disk faster than fewer large ones, and a small piece keeps the checksum
# left after its last read short (bench/README.md, "request size").
CHUNK = 1 << 20


PARTIAL = ".partial"            # the name of a pack being written, where it has one (packwrite.py)


class ChecksumError(SourceError):
    """An expert's bytes do not match the checksum in the packed header."""


# -- header -------------------------------------------------------------------------------
def _fail(path: str, msg: str):
    raise SourceError(f"{path}: {msg}")


def _count(v) -> bool:
    """A JSON integer >= 0 (not 53248.0, not true): header numbers become offsets and slices."""
    return type(v) is int and v >= 0


def _spec(w) -> TensorSpec:
    name, dtype, shape, offset, nbytes = w
    if not (isinstance(name, str) and isinstance(dtype, str) and isinstance(shape, list)
            and all(_count(v) for v in [*shape, offset, nbytes])):
        raise ValueError(f"layout entry {w!r} is not [name, dtype, [dims >= 0], offset >= 0, nbytes >= 0]")
    return TensorSpec(name, dtype, tuple(shape), offset, nbytes)


def read_header(path: str) -> tuple[dict, int]:
    """Validate a packed file's header against the file; returns (header, file size)."""
    if path.endswith(PARTIAL):
        _fail(path, "an unfinished `k3d pack` output (interrupted, or still being written); run the pack again")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise SourceError(f"{path}: cannot open ({e.strerror})") from None
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)   # read the header, not the experts after it
        size = os.fstat(fd).st_size
        head = os.pread(fd, 16, 0)
        if len(head) < 16 or head[:8] != MAGIC:
            if len(head) >= 8 and head[:8] == bytes(8):
                _fail(path, "not a k3d packed file: the header is empty (an interrupted `k3d pack`?)")
            _fail(path, "not a k3d packed file (bad magic)")
        n = int.from_bytes(head[8:16], "little")
        if n > MAX_HEADER or 16 + n > size:
            _fail(path, f"header length {n} runs past the end of the file ({size} bytes)")
        raw = os.pread(fd, n, 16)
    except OSError as e:                # a directory named *.k3pack, an I/O error
        raise SourceError(f"{path}: cannot read ({e.strerror or e})") from None
    finally:
        os.close(fd)
    try:
        h = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        _fail(path, f"header is not valid JSON ({e})")
    if not isinstance(h, dict) or h.get("format") != FORMAT:
        _fail(path, f"header format is not {FORMAT!r}")
    if h.get("version") not in (1, VERSION):
        _fail(path, f"packed format version {h.get('version')!r} is not supported (this k3d reads 1 and {VERSION})")
    try:
        layout = [_spec(w) for w in h["layout"]]
        span, stride, data_offset = h["span"], h["stride"], h["data_offset"]
        keys = [(l, e) for l, e in h["keys"]]
        sums = h["checksums"]
        tensor_format = h["tensor_format"]
    except (KeyError, TypeError, ValueError) as e:
        _fail(path, f"header lacks or mangles a field ({type(e).__name__}: {e})")
    if not all(_count(v) for v in (span, stride, data_offset)):
        _fail(path, f"span, stride and data_offset must be integers >= 0, not {span!r}, {stride!r}, {data_offset!r}")
    if not keys or not all(_count(l) and _count(e) for l, e in keys):
        _fail(path, "keys must be a non-empty list of [layer, expert] integers >= 0")
    source, types = h.get("source", {}), h.get("tensor_types", {})
    if not (isinstance(source, dict) and all(isinstance(v, str) for v in source.values())):
        _fail(path, f"source {source!r} is not an object of strings")
    if not (isinstance(types, dict) and all(isinstance(v, str) for v in types.values())):
        _fail(path, f"tensor_types {types!r} is not an object of strings")
    _check_layout(path, layout, "layout")
    groups = {}
    if h["version"] == 2:
        groups = _layer_layouts(path, h.get("layouts"), keys)
    for layer in sorted(groups):
        if _count(span) and layout_bytes(groups[layer]) > span:
            _fail(path, f"layer {layer}'s layout spans {layout_bytes(groups[layer])} bytes, more than the "
                        f"{span}-byte slot (span) the header gives every expert")
    sizes = [layout_bytes(layout)] + [layout_bytes(g) for g in groups.values()]
    if span != max(sizes):
        _fail(path, f"span {span} is not the layout's {max(sizes)} bytes (the largest layer's)")
    if span == 0:
        _fail(path, "the layout's tensors hold no bytes")
    if stride != align(span, PAGE):
        _fail(path, f"stride {stride} is not the span {span} rounded up to 4096")
    if not isinstance(data_offset, int) or data_offset % PAGE or data_offset < 16 + n:
        _fail(path, f"data offset {data_offset!r} is not a 4096 multiple past the header")
    if len(set(keys)) != len(keys) or keys != sorted(keys):
        _fail(path, "keys are not unique and in (layer, expert) order")
    if not isinstance(sums, list) or len(sums) != len(keys):
        _fail(path, f"{len(sums) if isinstance(sums, list) else 'no'} checksums for {len(keys)} experts")
    try:
        h["_crcs"] = [int(c, 16) for c in sums]
    except (TypeError, ValueError):
        _fail(path, "checksums are not hex crc32 strings")
    want = data_offset + len(keys) * stride
    if size != want:
        what = "truncated" if size < want else "has trailing bytes"
        _fail(path, f"{what}: {size} bytes, the header describes {want} ({len(keys)} experts x {stride})")
    h["_layout"], h["_keys"], h["_layouts"] = layout, keys, groups
    if not isinstance(tensor_format, str):
        _fail(path, "tensor_format is not a string")
    return h, size


def _check_layout(path: str, layout: list[TensorSpec], what: str) -> None:
    for s in layout:
        if s.dtype not in DTYPES:
            _fail(path, f"{what} tensor {s.name!r} has unknown dtype {s.dtype!r}")
        if s.nbytes != math.prod(s.shape) * DTYPES[s.dtype][0]:
            _fail(path, f"{what} tensor {s.name!r} spans {s.nbytes} bytes but {s.dtype}{list(s.shape)} needs "
                        f"{math.prod(s.shape) * DTYPES[s.dtype][0]}")
    rebuilt = build_layout([(s.name, s.dtype, s.shape, s.nbytes) for s in layout])
    if rebuilt != sorted(layout, key=lambda s: s.name) or not layout:
        _fail(path, f"{what} offsets are not the slot layout (sorted names, 64-byte aligned)")


def _layer_layouts(path: str, groups, keys) -> dict[int, list[TensorSpec]]:
    """Version 2: ``layouts`` = [[[layers], layout, {name: tensor type}], ...] covering every layer."""
    out: dict[int, list[TensorSpec]] = {}
    try:
        for layers, wire, types in groups:
            layout = [_spec(w) for w in wire]
            if not (isinstance(types, dict) and all(isinstance(v, str) for v in types.values())):
                raise ValueError(f"tensor types {types!r} are not an object of strings")
            for layer in layers:
                if not _count(layer) or layer in out:
                    raise ValueError(f"layer {layer!r} is not an integer >= 0 named once")
                _check_layout(path, layout, f"layer {layer}'s layout")
                out[layer] = layout
    except (TypeError, ValueError) as e:
        _fail(path, f"layouts is not [[layers], layout, tensor types] per layer ({e})")
    missing = sorted({l for l, _ in keys} - set(out))
    if missing:
        _fail(path, f"layouts do not give layer {missing[0]}'s layout")
    return out


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
