"""Where a local checkpoint keeps the expert tensors a daemon serves, and their digest.

``locate(path, model, layout_of)`` finds, in the checkpoint at ``path``, every
expert tensor in the daemon's terms: ``{(layer, expert): {name: Piece}}`` (file,
offset, bytes of that expert's tensor) and ``{layer: [(name, dtype, shape)]}``.
The daemon's ``hello`` (``model``: layers, experts per layer; ``layout_of``: the
layout names) guides the names, so one rule serves every family:

- safetensors (a directory with ``model.safetensors.index.json``,
  ``model.safetensors`` or ``*.safetensors``; or one file): a key under
  ``layers.{L}.`` / ``blocks.{L}.`` is per expert when it ends
  ``.experts.{E}.{name}``, and stacked (expert index outermost; DBRX's ``[E*I, H]``
  too) when the daemon's family is a stacked one and the key ends ``.{name}`` for
  a name it serves in layer L (of several such keys: the one whose ``1/E`` slice
  has the served size, not under attention, not shared, under ``.experts.``);
  expert e of a stacked tensor is its e-th ``1/E`` slice.  Per-expert keys the
  daemon does not serve are kept (as parts the daemon lacks), so a checkpoint
  with more is told apart too.  The index's ``weight_map`` decides which shard
  holds a tensor.
  A daemon started with ``--pattern P`` says so (``family_rule``): P is then the
  one rule, as the daemon applies it.
- GGUF (magic ``GGUF``; read with the ``gguf`` package): ``blk.{L}.{name}`` stacked
  over ``ne[-1]`` experts, and older per-expert ``blk.{L}.{stem}.{E}.{suffix}``;
  dtype and shape are the daemon's where the bytes per expert agree.
- k3d packs (magic ``K3DPACK``): the pack header's keys and layouts.

``digest(path, model, layout_of)`` then reads the rule's samples
(``k3client.digest``: at most 32 KiB a tensor) with ``pread`` on a small thread
pool, without readahead, drops those pages from the page cache again
(``POSIX_FADV_DONTNEED``: the process that verifies holds no expert page), and
assembles the digest.  ``Unsupported`` is a local file this module cannot read (one line).

Pure functions and a private pool; no shared state.
"""

from __future__ import annotations

import json
import os
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .digest import assemble, sample_ranges, tensor_hash

INDEX = "model.safetensors.index.json"
LAYER = re.compile(r"(?:^|\.)(?:layers|blocks)\.(\d+)\.(.+)\Z")
PER_EXPERT = re.compile(r"(?:^|\.)experts\.(\d+)\.(.+)\Z")
GGUF_STACKED = re.compile(r"blk\.(\d+)\.(.+)\Z")
GGUF_LEGACY = re.compile(r"blk\.(\d+)\.(ffn_[A-Za-z0-9_]+)\.(\d+)\.([A-Za-z0-9_]+)\Z")
PACK_MAGIC = b"K3DPACK\n"
PAGE = os.sysconf("SC_PAGE_SIZE")
# scattered 4 KiB reads are latency-bound: many in flight (bench/digest_cost.py, "client verify")
THREADS = 16


class Unsupported(Exception):
    """The local checkpoint's format cannot be compared (one line)."""


@dataclass(frozen=True)
class Piece:
    file: str
    offset: int
    nbytes: int


class Found:
    """What ``locate`` found: per layer the specs, per expert the pieces."""

    def __init__(self):
        self.specs: dict[int, dict[str, tuple[str, tuple]]] = {}
        self.pieces: dict[tuple[int, int], dict[str, Piece]] = {}

    def add(self, layer, expert, name, dtype, shape, piece):
        self.specs.setdefault(layer, {}).setdefault(name, (dtype, tuple(shape)))
        self.pieces.setdefault((layer, expert), {})[name] = piece


def _served(model: dict, layout_of) -> tuple[dict[int, dict], int]:
    layers = model.get("layers") or []
    per_layer = model.get("experts_per_layer") or 0
    return {l: {s.name: s for s in layout_of(l)} for l in layers}, int(per_layer)


def locate(path: str, model: dict, layout_of) -> Found:
    """See the module docstring; ``Unsupported`` or ``OSError`` for what cannot be read."""
    served, n_experts = _served(model, layout_of)
    # per-expert families (rule ``experts.*``) have no stacked tensors: a shared expert's
    # ``...shared_experts.gate_proj.weight`` must not be taken for one
    by_name = not str(model.get("family_rule") or "").startswith("experts.")
    pattern = user_pattern(model)
    if os.path.isdir(path):
        files, owner = _shards(path)
        return _safetensors(files, owner, served, n_experts, by_name, pattern)
    head = _pread_head(path, 8, 0)
    if head[:4] == b"GGUF":
        return _gguf(path, served, n_experts)
    if head == PACK_MAGIC:
        return _pack(path)
    if path.endswith(".json"):
        files, owner = _index(path)
        return _safetensors(files, owner, served, n_experts, by_name, pattern)
    if path.endswith(".safetensors"):
        return _safetensors([path], None, served, n_experts, by_name, pattern)
    raise Unsupported(f"{path}: not a safetensors checkpoint, GGUF file or k3d pack; k3client cannot compare it")


def _shards(path: str):
    if os.path.exists(os.path.join(path, INDEX)):
        return _index(os.path.join(path, INDEX))
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single], None
    found = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    if not found:
        raise Unsupported(f"{path}: no {INDEX}, model.safetensors or *.safetensors to compare")
    return found, None


def _index(index: str):
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise Unsupported(f"{index}: not a usable safetensors index ({e})") from None
    base = os.path.dirname(index)
    owner = {t: os.path.join(base, n) for t, n in weight_map.items()}
    return sorted(set(owner.values())), owner


def _pread_head(path: str, n: int, offset: int) -> bytes:
    """Header bytes by ``pread`` without readahead: a readahead window would leave a mark whose
    later hit sets off readahead of expert pages even on a RANDOM descriptor."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return os.pread(fd, n, offset)
    finally:
        os.close(fd)


def _header(path: str) -> tuple[dict, int]:
    raw = _pread_head(path, 8, 0)
    if len(raw) != 8:
        raise Unsupported(f"{path}: not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", raw)
    if n > 100 << 20:
        raise Unsupported(f"{path}: safetensors header of {n} bytes (corrupt?)")
    try:
        hdr = json.loads(_pread_head(path, n, 8))
    except ValueError as e:
        raise Unsupported(f"{path}: unreadable safetensors header ({e})") from None
    hdr.pop("__metadata__", None)
    return hdr, 8 + n


def _stacked_name(rest: str, names, by_name: bool) -> str | None:
    """The daemon's name a stacked key ends with (the longest)."""
    hits = [n for n in names if rest == n or rest.endswith("." + n)] if by_name else []
    return max(hits, key=len) if hits else None


def _rank(rest: str) -> tuple:
    """Of two stacked keys ending in one served name, the routed MLP experts' (not JetMoE's
    attention experts', not a shared MLP's)."""
    return ("attn" not in rest and "attention" not in rest, "shared" not in rest, ".experts." in "." + rest)


def user_pattern(model: dict) -> re.Pattern | None:
    """The daemon's ``--pattern`` (its ``family_rule`` says ``pattern (--pattern P)``) as a regex."""
    rule = str(model.get("family_rule") or "")
    if not (rule.startswith("pattern (--pattern ") and rule.endswith(")")):
        return None
    rx = re.escape(rule[len("pattern (--pattern "):-1])
    for field, group in (("layer", r"(?P<layer>\d+)"), ("expert", r"(?P<expert>\d+)"), ("name", "(?P<name>.+)")):
        rx = rx.replace(re.escape("{" + field + "}"), group)
    return re.compile(rx + r"\Z")


def _safetensors(files, owner, served, n_experts, by_name: bool, pattern=None) -> Found:
    out = Found()
    stacked: dict[tuple[int, str], tuple] = {}
    for path in files:
        header, start = _header(path)
        for key, info in header.items():
            if owner is not None and owner.get(key, path) != path:
                continue                      # a stale copy the index does not use
            if pattern is not None:           # the daemon's own rule, nothing guessed
                m = pattern.match(key)
                if m:
                    b, e = info["data_offsets"]
                    out.add(int(m["layer"]), int(m["expert"]), m["name"], info["dtype"], info["shape"],
                            Piece(path, start + b, e - b))
                continue
            m = LAYER.search(key)
            if not m:
                continue
            layer, rest = int(m.group(1)), m.group(2)
            dtype, shape, (b, e) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            pe = PER_EXPERT.search(rest)
            if pe:
                out.add(layer, int(pe.group(1)), pe.group(2), dtype, shape, Piece(path, start + b, e - b))
                continue
            name = _stacked_name(rest, served.get(layer, {}), by_name)
            if name is None or not shape or not n_experts or shape[0] % n_experts:
                continue
            spec = served.get(layer, {}).get(name)
            cand = (spec.nbytes == (e - b) // n_experts, *_rank(rest), path, start + b, e - b, dtype, shape)
            if (layer, name) not in stacked or cand[:4] > stacked[(layer, name)][:4]:
                stacked[(layer, name)] = cand
    for (layer, name), (*_, path, begin, nbytes, dtype, shape) in stacked.items():
        slab = nbytes // n_experts
        per = shape[1:] if shape[0] == n_experts else (shape[0] // n_experts, *shape[1:])
        for x in range(n_experts):
            out.add(layer, x, name, dtype, per, Piece(path, begin + x * slab, slab))
    return out


def _gguf(path: str, served, n_experts) -> Found:
    # optional: only a local GGUF file needs it
    try:
        from gguf import GGUFReader
    except ImportError:
        raise Unsupported(f"{path}: comparing a local GGUF file needs the gguf package (pip install gguf)") from None
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as e:
        raise Unsupported(f"{path}: unreadable GGUF file ({e})") from None
    out = Found()
    for t in reader.tensors:
        m = GGUF_LEGACY.match(t.name)
        if m:
            layer, x, name = int(m[1]), int(m[3]), f"{m[2]}.{m[4]}"
            _gguf_add(out, served, layer, x, name, Piece(path, int(t.data_offset), int(t.n_bytes)), t)
            continue
        m = GGUF_STACKED.match(t.name)
        if not m or "_exps." not in m[2] or not n_experts or int(t.shape[-1]) != n_experts:
            continue
        layer, name = int(m[1]), m[2]
        slab = int(t.n_bytes) // n_experts
        for x in range(n_experts):
            _gguf_add(out, served, layer, x, name, Piece(path, int(t.data_offset) + x * slab, slab), t)
    return out


def _gguf_add(out: Found, served, layer, x, name, piece: Piece, t) -> None:
    spec = served.get(layer, {}).get(name)
    if spec is not None and spec.nbytes == piece.nbytes:
        dtype, shape = spec.dtype, spec.shape
    else:                                       # not served as such: named by its GGML type and bytes
        dtype, shape = f"ggml:{t.tensor_type.name}", (piece.nbytes,)
    out.add(layer, x, name, dtype, shape, piece)


def _pack(path: str) -> Found:
    (n,) = struct.unpack("<Q", _pread_head(path, 8, 8))
    try:
        h = json.loads(_pread_head(path, n, 16))
    except ValueError as e:
        raise Unsupported(f"{path}: unreadable k3d pack header ({e})") from None
    layouts = {}
    for layers, wire, *_ in h.get("layouts") or []:
        for layer in layers:
            layouts[int(layer)] = wire
    out = Found()
    for i, (layer, x) in enumerate(h["keys"]):
        base = h["data_offset"] + i * h["stride"]
        for name, dtype, shape, off, nbytes in layouts.get(layer, h["layout"]):
            out.add(int(layer), int(x), name, dtype, shape, Piece(path, base + off, nbytes))
    return out


def _hashes(found: Found, key, fds) -> dict[str, bytes]:
    out = {}
    for name, p in found.pieces[key].items():
        fd, ranges = fds[p.file], sample_ranges(p.nbytes)
        chunks = [os.pread(fd, n, p.offset + s) for s, n in ranges]
        if sum(map(len, chunks)) != sum(n for _, n in ranges):
            raise Unsupported(f"{p.file}: shorter than its header says (truncated?)")
        for s, n in ranges:     # the samples leave the page cache again: the daemon holds the experts
            lo = (p.offset + s) // PAGE * PAGE          # whole pages: DONTNEED keeps partial ones
            os.posix_fadvise(fd, lo, -(-(p.offset + s + n - lo) // PAGE) * PAGE, os.POSIX_FADV_DONTNEED)
        out[name] = tensor_hash(p.nbytes, chunks)
    return out


def digest(path: str, model: dict, layout_of, threads: int | None = None) -> dict:
    """The rule's digest of the local checkpoint at ``path``, in the daemon's terms."""
    found = locate(path, model, layout_of)
    fds = {}
    try:
        for p in {p.file for per in found.pieces.values() for p in per.values()}:
            fds[p] = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
            os.posix_fadvise(fds[p], 0, 0, os.POSIX_FADV_RANDOM)     # the samples only, no readahead
        keys = sorted(found.pieces)
        with ThreadPoolExecutor(max_workers=threads or THREADS) as pool:
            hashes = dict(zip(keys, pool.map(lambda k: _hashes(found, k, fds), keys)))
    finally:
        for fd in fds.values():
            os.close(fd)
    specs = {l: [(n, d, s) for n, (d, s) in per.items()] for l, per in found.specs.items()}
    return assemble(specs, hashes)

