"""The packed format (``.k3pack``): its file layout and ``read_header``, which validates a header.

packed.py reads experts from a pack (``PackedSource``); packwrite.py writes packs;
``k3d pack`` is k3d/commands/pack.py.

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
- ``read_header`` accepts a header only if every field checks against the others
  and against the file's size; each refusal is one ``SourceError`` naming the
  file and the field.

Thread: ``read_header`` is a pure function of the file (it reads the header with
readahead off and closes its descriptor); callers run it once, on the thread that
opens the source.
"""

from __future__ import annotations

import json
import math
import os

from k3client.layout import DTYPES, TensorSpec, align, build_layout, layout_bytes

from .base import PAGE, SourceError

MAGIC = b"K3DPACK\n"
FORMAT = "k3d-pack"
VERSION = 2                     # written when layers' layouts differ; uniform packs stay version 1
MAX_HEADER = 1 << 30
PARTIAL = ".partial"            # the name of a pack being written, where it has one (packwrite.py)


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
