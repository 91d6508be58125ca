"""GGUF files: experts stacked per layer, parsed by hand (checked against ``gguf.GGUFReader``).

File format (little-endian, versions 2 and 3)::

    "GGUF" u32 version  u64 n_tensors  u64 n_kv
    n_kv x        (string key, u32 value_type, value)       string = u64 len + UTF-8 bytes
    n_tensors x   (string name, u32 n_dims, u64 ne[n_dims], u32 ggml_type, u64 offset)
    zero padding to ``general.alignment`` (default 32)
    data: tensor t at data_start + offset_t, nbytes_t = prod(ne[1:]) * ne[0] / block * type_size

``ne[0]`` is the innermost (fastest) dimension; numpy order is ``ne`` reversed.

Experts: every tensor ``blk.{L}.ffn_*_exps.*`` (gate/up/down weights, and biases
where a model has them) is stacked with the expert index outermost
(``ne[-1] = n_expert``), so expert ``e`` of such a tensor is one slab at
``data_start + offset + e * slab_bytes``.  Expert ``(L, e)`` is those slabs, one
extent each, read straight into its slot.  Layout names are the tensor names
without ``blk.{L}.`` (``ffn_down_exps.weight`` ...).  Plain element types (F32,
F16, BF16, integers) keep their dtype and per-expert shape; block-quantized
types (MXFP4, Q8_0, Q4_K ...) are served as raw bytes: dtype ``U8``, shape
``(rows..., row_bytes)``.  ``tensor_format`` says which: ``ggml:MXFP4`` when all
expert tensors share one GGML type, else ``ggml:name=TYPE,...``; ``describe()``
adds ``tensor_types`` {name: "ggml:TYPE"} so a client never guesses.

Checks at start-up, each one SourceError line naming the file (and tensor):
bad magic or version, big-endian files, a header running past the end of the
file, an unknown GGML type, a row not a whole number of blocks, an offset not
on the alignment, tensors that overlap or run past the end (a truncated file),
no expert tensors, stacked tensors with different expert counts, an
``{arch}.expert_count`` that disagrees, and a layer whose expert tensors differ
(names, types or shapes) from the first layer's.

The GGML type table is ours (the daemon does not import ``gguf``); a test
checks it against ``gguf.constants.GGML_QUANT_SIZES``.

Thread: built on the main thread; read-only after construction; ``read`` (the base class's
preadv) is called by many reader threads at once.
"""

from __future__ import annotations

import math
import os
import re
import struct

from k3client.layout import build_layout

from .base import Extent, Source, SourceError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4

# ggml type id -> (name, block size in elements, bytes per block)
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}
# element types served with their own dtype (safetensors names); the rest are U8 bytes
ELEMENT_DTYPES = {"F32": "F32", "F16": "F16", "BF16": "BF16", "F64": "F64",
                  "I8": "I8", "I16": "I16", "I32": "I32", "I64": "I64"}

# GGUF metadata value types: id -> struct format of a scalar (None: string / array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_STRING = 1 << 30

EXPERT_RX = re.compile(r"blk\.(\d+)\.(ffn_[A-Za-z0-9_]+_exps\.[A-Za-z0-9_.]+)\Z")


class _Header:
    """Sequential reader of the header with bounds checks (a short file is a SourceError)."""

    def __init__(self, path: str, f, file_len: int):
        self.path, self.f, self.file_len, self.pos = path, f, file_len, 0

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > self.file_len:
            raise SourceError(f"{self.path}: truncated GGUF header: {what} at offset {self.pos} needs {n} bytes, "
                              f"the file has {self.file_len}")
        b = self.f.read(n)
        if len(b) != n:
            raise SourceError(f"{self.path}: short read in the GGUF header at offset {self.pos} ({what})")
        self.pos += n
        return b

    def u32(self, what: str) -> int:
        return struct.unpack("<I", self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack("<Q", self.take(8, what))[0]

    def string(self, what: str) -> str:
        n = self.u64(what)
        if n > _MAX_STRING:
            raise SourceError(f"{self.path}: {what} at offset {self.pos - 8} claims {n} bytes")
        raw = self.take(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise SourceError(f"{self.path}: {what} at offset {self.pos - n} is not UTF-8") from None

    def value(self, vtype: int, what: str, depth: int = 0):
        """Parse (or, for arrays, skip) one metadata value; returns scalars and strings."""
        if vtype in _SCALARS:
            fmt = _SCALARS[vtype]
            return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY and depth < 4:
            etype, count = self.u32(what), self.u64(what)
            if etype in _SCALARS:
                # fixed-size elements: skip them in one bounds-checked seek
                size = struct.calcsize(_SCALARS[etype]) * count
                if self.pos + size > self.file_len:
                    raise SourceError(f"{self.path}: truncated GGUF header: {what} array of {count} runs past the end")
                self.f.seek(size, os.SEEK_CUR)
                self.pos += size
            else:
                if count > self.file_len:
                    raise SourceError(f"{self.path}: {what} claims {count} array elements")
                for _ in range(count):
                    self.value(etype, what, depth + 1)
            return None
        raise SourceError(f"{self.path}: {what} has unknown GGUF value type {vtype}")


def parse_gguf(path: str) -> tuple[int, dict, dict]:
    """Validate a GGUF header; returns (data_start, metadata scalars, {name: (type, ne, abs_offset, nbytes)})."""
    try:
        f = open(path, "rb", buffering=1 << 20)
    except OSError as e:
        raise SourceError(f"{path}: cannot open ({e.strerror})") from None
    with f:
        file_len = os.fstat(f.fileno()).st_size
        h = _Header(path, f, file_len)
        if file_len < 24:
            raise SourceError(f"{path}: too short to be a GGUF file ({file_len} bytes)")
        if h.take(4, "magic") != MAGIC:
            raise SourceError(f"{path}: not a GGUF file (magic is not 'GGUF')")
        version = h.u32("version")
        if version & 0xFFFF == 0 and version:
            raise SourceError(f"{path}: big-endian GGUF is not supported")
        if version not in (2, 3):
            raise SourceError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = h.u64("tensor count"), h.u64("metadata count")
        if n_tensors > file_len or n_kv > file_len:
            raise SourceError(f"{path}: header claims {n_tensors} tensors and {n_kv} metadata entries "
                              f"in a {file_len} byte file")
        meta = {}
        for i in range(n_kv):
            key = h.string(f"metadata key #{i}")
            v = h.value(h.u32(f"type of {key!r}"), f"metadata {key!r}")
            if v is not None:
                meta[key] = v
        infos = []
        for i in range(n_tensors):
            name = h.string(f"tensor name #{i}")
            nd = h.u32(f"dimension count of {name!r}")
            if not 1 <= nd <= MAX_DIMS:
                raise SourceError(f"{path}: tensor {name!r} has {nd} dimensions (1..{MAX_DIMS})")
            ne = tuple(h.u64(f"shape of {name!r}") for _ in range(nd))
            gtype = h.u32(f"type of {name!r}")
            off = h.u64(f"offset of {name!r}")
            infos.append((name, ne, gtype, off))
        align = meta.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise SourceError(f"{path}: general.alignment {align!r} is not a power of two")
        data_start = (h.pos + align - 1) // align * align
    tensors = {}
    for name, ne, gtype, off in infos:
        if gtype not in GGML_TYPES:
            raise SourceError(f"{path}: tensor {name!r} has unknown GGML type {gtype}")
        tname, block, tsize = GGML_TYPES[gtype]
        if any(d == 0 for d in ne) or ne[0] % block:
            raise SourceError(f"{path}: tensor {name!r} shape {list(ne)} is not a whole number of "
                              f"{tname} blocks of {block}")
        if off % align:
            raise SourceError(f"{path}: tensor {name!r} offset {off} is not a multiple of the alignment {align}")
        if name in tensors:
            raise SourceError(f"{path}: tensor {name!r} appears twice")
        nbytes = math.prod(ne[1:]) * (ne[0] // block) * tsize
        start = data_start + off
        if start + nbytes > file_len:
            raise SourceError(f"{path}: truncated: tensor {name!r} needs bytes [{start}, {start + nbytes}) "
                              f"but the file has {file_len}")
        tensors[name] = (gtype, ne, start, nbytes)
    prev_end, prev = data_start, None
    for name, (_, _, start, nbytes) in sorted(tensors.items(), key=lambda kv: kv[1][2]):
        if start < prev_end:
            raise SourceError(f"{path}: tensor {name!r} at {start} overlaps tensor {prev!r} (ends at {prev_end})")
        prev_end, prev = start + nbytes, name
    return data_start, meta, tensors


def slab_spec(path: str, name: str, gtype: int, ne: tuple[int, ...]) -> tuple[str, tuple[int, ...], int]:
    """(dtype, per-expert numpy shape, slab bytes) of one expert's slice of a stacked tensor."""
    tname, block, tsize = GGML_TYPES[gtype]
    element = tname in ELEMENT_DTYPES
    if len(ne) == 1:
        # one value per expert (a per-expert scale): only element types split per expert
        if not element:
            raise SourceError(f"{path}: 1-d expert tensor {name!r} is {tname}: its blocks span several experts")
        return ELEMENT_DTYPES[tname], (), tsize
    inner = tuple(reversed(ne[:-1]))           # numpy order, expert dimension dropped
    row_bytes = ne[0] // block * tsize
    nbytes = math.prod(ne[1:-1]) * row_bytes
    if element:
        return ELEMENT_DTYPES[tname], inner, nbytes
    return "U8", inner[:-1] + (row_bytes,), nbytes


class GGUFSource(Source):
    kind = "gguf"

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        data_start, meta, tensors = parse_gguf(path)
        layers: dict[int, dict[str, tuple]] = {}
        for tname, (gtype, ne, start, nbytes) in tensors.items():
            m = EXPERT_RX.match(tname)
            if m:
                per = layers.setdefault(int(m[1]), {})
                if m[2] in per:                 # blk.1.x and blk.01.x: which one is layer 1?
                    raise SourceError(f"{path}: tensors {per[m[2]][4]!r} and {tname!r} are both "
                                      f"layer {int(m[1])}'s {m[2]!r}; remove one")
                per[m[2]] = (gtype, ne, start, nbytes, tname)
        if not layers:
            raise SourceError(f"{path}: no expert tensors (blk.N.ffn_*_exps.*) in this GGUF file")
        counts = {v[1][-1] for per in layers.values() for v in per.values()}
        if len(counts) != 1:
            first = {}
            for per in layers.values():
                for v in per.values():
                    first.setdefault(v[1][-1], v[4])
            a, b = sorted(first)[:2]
            raise SourceError(f"{path}: stacked expert tensors disagree on the expert count: "
                              f"{first[a]!r} has {a}, {first[b]!r} has {b}")
        n_expert = counts.pop()
        arch = meta.get("general.architecture")
        declared = meta.get(f"{arch}.expert_count") if isinstance(arch, str) else None
        if isinstance(declared, int) and declared != n_expert:
            raise SourceError(f"{path}: {arch}.expert_count says {declared} but the expert tensors stack {n_expert}")
        ref_layer = min(layers)
        ref = {n: (v[0], v[1]) for n, v in layers[ref_layer].items()}
        for layer in sorted(layers):
            got = {n: (v[0], v[1]) for n, v in layers[layer].items()}
            if got != ref:
                raise SourceError(self._mismatch(layer, ref_layer, ref, got))
        specs = {n: slab_spec(path, f"blk.{ref_layer}.{n}", g, ne) for n, (g, ne) in ref.items()}
        self.layout = build_layout([(n, d, s, nb) for n, (d, s, nb) in specs.items()])
        names = {n: GGML_TYPES[g][0] for n, (g, _) in ref.items()}
        self.tensor_types = {n: f"ggml:{t}" for n, t in sorted(names.items())}
        if len(set(names.values())) == 1:
            self.tensor_format = f"ggml:{next(iter(names.values()))}"
        else:
            self.tensor_format = "ggml:" + ",".join(f"{n}={t}" for n, t in sorted(names.items()))
        self.files = [path]
        for layer in sorted(layers):
            per = layers[layer]
            for e in range(n_expert):
                self.keys[(layer, e)] = [Extent(0, per[s.name][2] + e * s.nbytes, s.offset, s.nbytes)
                                         for s in self.layout if s.nbytes]
        self.fds = [os.open(path, os.O_RDONLY | os.O_CLOEXEC)]

    def describe(self) -> dict:
        d = super().describe()
        d["tensor_types"] = dict(self.tensor_types)
        return d

    def _mismatch(self, layer, ref_layer, ref, got) -> str:
        missing = sorted(set(ref) - set(got))
        extra = sorted(set(got) - set(ref))
        if missing:
            return f"{self.path}: layer {layer} lacks expert tensor blk.{layer}.{missing[0]} that layer {ref_layer} has"
        if extra:
            return f"{self.path}: layer {layer} has expert tensor blk.{layer}.{extra[0]} that layer {ref_layer} lacks"
        name = next(n for n in sorted(ref) if ref[n] != got[n])

        def fmt(v):
            return f"{GGML_TYPES[v[0]][0]}{list(v[1])}"
        return (f"{self.path}: tensor blk.{layer}.{name} is {fmt(got[name])}, "
                f"but blk.{ref_layer}.{name} is {fmt(ref[name])} (shapes in GGML order)")
