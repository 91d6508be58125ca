"""GGUF files: experts stacked per layer, parsed by hand (checked against ``gguf.GGUFReader``).

File format (little-endian, versions 2 and 3)::

    "GGUF" u32 version  u64 n_tensors  u64 n_kv
    n_kv x        (string key, u32 value_type, value)       string = u64 len + UTF-8 bytes
    n_tensors x   (string name, u32 n_dims, u64 ne[n_dims], u32 ggml_type, u64 offset)
    zero padding to ``general.alignment`` (default 32)
    data: tensor t at data_start + offset_t, nbytes_t = prod(ne[1:]) * ne[0] / block * type_size

``ne[0]`` is the innermost (fastest) dimension; numpy order is ``ne`` reversed.

Experts: every tensor ``blk.{L}.ffn_*_exps.*`` (gate/up/down weights, fused
``ffn_gate_up_exps``, and biases where a model has them) is stacked with the
expert index outermost (``ne[-1] = n_expert``), so expert ``e`` of such a tensor
is one slab at ``data_start + offset + e * slab_bytes``.  Expert ``(L, e)`` is
those slabs, one extent each, read straight into its slot.  Layout names are the
tensor names without ``blk.{L}.`` (``ffn_down_exps.weight`` ...).  Older files
(Mixtral) keep one tensor per expert, ``blk.{L}.ffn_{gate,up,down}.{E}.weight``:
layout names ``ffn_gate.weight`` ....  ``*_exps`` tensors that are not stacked
over the experts (Arctic's ``ffn_norm_exps``, a norm) are left out.

Plain element types (F32, F16, BF16, integers) keep their dtype and per-expert
shape; block-quantized types (MXFP4, Q8_0, Q4_K ...) are served as raw bytes:
dtype ``U8``, shape ``(rows..., row_bytes)``.  Types may differ by layer (a
Q4_K_M / Q5_K_M file gives some layers' ``ffn_down_exps`` Q6_K, others Q4_K):
each layer then has its own layout (``Source.layouts``) and its own
``layer_tensor_types`` {name: "ggml:TYPE"}, sent to clients in ``model.layouts``;
``tensor_types`` is the lowest layer's.  ``tensor_format`` is ``ggml:MXFP4``
when every expert tensor of every layer has one GGML type, else
``ggml:name=TYPE|TYPE,...`` (the types each tensor takes, over all layers).

Checks at start-up, each one SourceError line naming the file (and tensor):
bad magic or version, big-endian files, a header running past the end of the
file, an unknown GGML type, a row not a whole number of blocks, an offset not
on the alignment, tensors that overlap or run past the end (a truncated file),
no expert tensors, gate/up/down tensors stacking different expert counts, an
``{arch}.expert_count`` that disagrees with them (or with a legacy file's
per-expert tensors), and an expert whose tensors differ from its layer's first.

The GGML type table is ours (the daemon does not import ``gguf``); a test
checks it against ``gguf.constants.GGML_QUANT_SIZES``.

Thread: built on the main thread; read-only after construction; ``read`` (the base class's
preadv) is called by many reader threads at once.
"""

from __future__ import annotations

import logging
import math
import os
import re
import struct

from .base import Source, SourceError

log = logging.getLogger("k3d")

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
# older llama.cpp files (Mixtral) keep one tensor per expert: blk.L.ffn_gate.E.weight
LEGACY_RX = re.compile(r"blk\.(\d+)\.(ffn_(?:gate|up|down|gate_up))\.(\d+)\.([A-Za-z0-9_]+)\Z")
NOT_EXPERTS = {"ffn_norm_exps"}                 # Arctic: a norm [n_embd], not stacked over experts
CORE_EXPERTS = {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps"}


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
        _, meta, tensors = parse_gguf(path)
        arch = meta.get("general.architecture")
        declared = meta.get(f"{arch}.expert_count") if isinstance(arch, str) else None
        declared = declared if isinstance(declared, int) and declared > 0 else None
        stacked, legacy = self._find(tensors)
        if not stacked and not legacy:
            first = ", ".join(sorted(tensors)[:5]) or "(none)"
            raise SourceError(f"{path}: no expert tensors (blk.N.ffn_*_exps.* or blk.N.ffn_gate.E.weight) "
                              f"in this GGUF file; first tensors: {first}")
        experts: dict[tuple[int, int], dict[str, tuple]] = {}
        types: dict[int, dict[str, str]] = {}
        if stacked:
            n_expert = self._expert_count(stacked, declared, arch)
            for layer, per in stacked.items():
                for name, (gtype, ne, start, _nbytes, tname) in per.items():
                    if ne[-1] != n_expert:      # not [E, ...]: a norm or a per-layer vector
                        log.info("%s: %s is %s, not stacked over the %d experts: left out",
                                 path, tname, list(ne), n_expert)
                        continue
                    dtype, shape, size = slab_spec(path, tname, gtype, ne)
                    types.setdefault(layer, {})[name] = f"ggml:{GGML_TYPES[gtype][0]}"
                    for e in range(n_expert):
                        experts.setdefault((layer, e), {})[name] = (dtype, shape, 0, start + e * size, size, tname)
        for (layer, e), per in legacy.items():
            for name, (gtype, ne, start, nbytes, tname) in per.items():
                tn, block, tsize = GGML_TYPES[gtype]
                inner = tuple(reversed(ne))
                if tn in ELEMENT_DTYPES:
                    dtype, shape = ELEMENT_DTYPES[tn], inner
                else:
                    dtype, shape = "U8", inner[:-1] + (ne[0] // block * tsize,)
                if (layer, e) in experts and name in experts[(layer, e)]:
                    raise SourceError(f"{path}: {tname!r} and a stacked tensor are both layer {layer}'s {name!r}")
                experts.setdefault((layer, e), {})[name] = (dtype, shape, 0, start, nbytes, tname)
                types.setdefault(layer, {})[name] = f"ggml:{tn}"
        if declared is not None and legacy:
            self._check_legacy_count(experts, declared, arch)
        if not experts:
            raise SourceError(f"{path}: no expert tensors stacked over the experts (blk.N.ffn_*_exps.*)")
        self.set_experts(path, experts)
        self.layer_tensor_types = {l: dict(sorted(t.items())) for l, t in types.items()}
        self.tensor_types = self.layer_tensor_types[min(self.layer_tensor_types)]
        seen: dict[str, set] = {}
        for t in self.layer_tensor_types.values():
            for n, ty in t.items():
                seen.setdefault(n, set()).add(ty.split(":", 1)[1])
        if len({ty for tys in seen.values() for ty in tys}) == 1:
            self.tensor_format = "ggml:" + next(iter(next(iter(seen.values()))))
        else:
            self.tensor_format = "ggml:" + ",".join(f"{n}={'|'.join(sorted(t))}" for n, t in sorted(seen.items()))
        used = meta.get(f"{arch}.expert_used_count") if isinstance(arch, str) else None
        self.family_fields = {
            "family": arch if isinstance(arch, str) else None,
            "family_rule": ("gguf blk.{layer}.ffn_*_exps [E, ...]" if stacked else "gguf blk.{layer}.ffn_*.{expert}")
            + " (general.architecture)",
            "top_k": used if isinstance(used, int) and used > 0 else None}
        self.files = [path]
        self.fds = [os.open(path, os.O_RDONLY | os.O_CLOEXEC)]

    def _find(self, tensors):
        """Stacked ``{layer: {name: tensor}}`` and legacy ``{(layer, e): {name: tensor}}`` expert tensors."""
        stacked: dict[int, dict[str, tuple]] = {}
        legacy: dict[tuple[int, int], dict[str, tuple]] = {}
        for tname, (gtype, ne, start, nbytes) in tensors.items():
            m = EXPERT_RX.match(tname)
            if m:
                if m[2].split(".")[0] in NOT_EXPERTS:
                    log.info("%s: %s is not an expert tensor: left out", self.path, tname)
                    continue
                per, name = stacked.setdefault(int(m[1]), {}), m[2]
            else:
                m = LEGACY_RX.match(tname)
                if not m:
                    continue
                per, name = legacy.setdefault((int(m[1]), int(m[3])), {}), f"{m[2]}.{m[4]}"
            if name in per:                     # blk.1.x and blk.01.x: which one is layer 1?
                raise SourceError(f"{self.path}: tensors {per[name][4]!r} and {tname!r} are both "
                                  f"layer {int(m[1])}'s {name!r}; remove one")
            per[name] = (gtype, ne, start, nbytes, tname)
        return stacked, legacy

    def _expert_count(self, stacked, declared, arch) -> int:
        """The experts the gate/up/down tensors stack (their outermost dimension): all must
        agree, and with ``{arch}.expert_count`` when the file has it."""
        first: dict[int, str] = {}
        for per in stacked.values():
            for name, v in per.items():
                if name.split(".")[0] in CORE_EXPERTS:
                    first.setdefault(v[1][-1], v[4])
        if len(first) > 1:
            a, b = sorted(first)[:2]
            raise SourceError(f"{self.path}: stacked expert tensors disagree on the expert count: "
                              f"{first[a]!r} has {a}, {first[b]!r} has {b}")
        if declared is not None:
            if first and next(iter(first)) != declared:
                n, t = next(iter(first.items()))
                raise SourceError(f"{self.path}: {arch}.expert_count says {declared} but the expert tensors "
                                  f"stack {n} ({t!r})")
            return declared
        if not first:
            raise SourceError(f"{self.path}: no ffn_{{gate,up,down,gate_up}}_exps tensor and no "
                              "{arch}.expert_count: cannot tell how many experts the tensors stack")
        return next(iter(first))

    def _check_legacy_count(self, experts, declared, arch) -> None:
        for layer in sorted({l for l, _ in experts}):
            got = sorted(e for l, e in experts if l == layer)
            if got != list(range(declared)):
                raise SourceError(f"{self.path}: {arch}.expert_count says {declared}, but layer {layer} has "
                                  f"experts {got[0]}-{got[-1]} ({len(got)})")

    def describe(self) -> dict:
        d = super().describe()
        d["tensor_types"] = dict(self.tensor_types)
        return d


