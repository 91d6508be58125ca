"""Local safetensors checkpoints: one file, or an index.json plus shards.

File format (parsed by hand, with the reference reader's limits)::

    [u64 little-endian N][N bytes JSON header][data ...]
    header: {"__metadata__": {...}?, name: {"dtype", "shape", "data_offsets": [b, e]}, ...}
    tensor bytes = file[8 + N + b : 8 + N + e]

Checks, each a SourceError naming the file and tensor: N <= 100,000,000 and a
``{`` after it (else the file is "not a safetensors file": random bytes, another
format), 8 + N <= file length; the header is a JSON object; every tensor's dtype is
known, ``e - b == prod(shape) * itemsize``, offsets are in bounds; the tensors
cover the data area without holes or overlaps (as the reference requires).

Names map to keys by the model's family (``k3d.sources.families``: config.json
beside the shards, else the tensor names; stacked tensors are sliced per expert),
or by ``pattern`` (``{layer}``, ``{expert}``, ``{name}``) when one is given; names
that are not routed experts (attention, norms, routers, shared experts) are ignored.  With an index,
a tensor is read from the shard its ``weight_map`` names (a copy elsewhere is
stale and ignored; a mapped tensor missing from its shard is an error);
without one, a tensor in two shards is an error, as are two names that map to
one expert tensor (``layers.1`` and ``layers.01``).  Each layer's layout is the
tensor set of its lowest expert in sorted name order; every other expert of the
layer must have the same names, dtypes and shapes, or start-up fails naming the
first that differs (``Source.set_experts``).

Thread: built on the main thread (headers parsed there); read-only after;
``read`` (the base class's preadv) runs on many reader threads at once.
"""

from __future__ import annotations

import json
import math
import os

from k3client.layout import DTYPES, itemsize

from .base import Source, SourceError
from .families import expert_pieces, no_match_hint, pattern_rule, settle

MAX_HEADER = 100_000_000
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"


def parse_header(path: str, raw_prefix: bytes, file_len: int) -> tuple[int, dict]:
    """Validate a safetensors header; returns (data_start, {name: (dtype, shape, b, e)})."""
    if len(raw_prefix) < 8 or file_len < 8:
        raise SourceError(f"{path}: too short to be a safetensors file ({file_len} bytes)")
    n = int.from_bytes(raw_prefix[:8], "little")
    if n > MAX_HEADER:
        raise SourceError(f"{path}: not a safetensors file (its first 8 bytes, a safetensors file's header size, "
                          f"read {n}: over the {MAX_HEADER}-byte limit)")
    # a safetensors header is a JSON object: anything else after the size is another kind of file,
    # where a "{" there with a bad size or bad JSON after it is a damaged (e.g. truncated) one
    if raw_prefix[8:9] not in (b"{", b""):
        raise SourceError(f"{path}: not a safetensors file (no JSON header after its first 8 bytes)")
    if 8 + n > file_len:
        raise SourceError(f"{path}: header size {n} runs past the end of the file ({file_len} bytes)")
    try:
        header = json.loads(raw_prefix[8:8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SourceError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise SourceError(f"{path}: header is not a JSON object")
    data_len = file_len - 8 - n
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = info["dtype"], info["shape"], info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise SourceError(f"{path}: tensor {name!r} has a malformed entry") from None
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise SourceError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        if not (isinstance(b, int) and isinstance(e, int) and 0 <= b <= e <= data_len):
            raise SourceError(f"{path}: tensor {name!r} offsets [{b}, {e}) out of bounds (data is {data_len} bytes)")
        if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
            raise SourceError(f"{path}: tensor {name!r} has a malformed shape {shape}")
        want = math.prod(shape) * DTYPES[dtype][0]
        if e - b != want:
            raise SourceError(f"{path}: tensor {name!r} spans {e - b} bytes but {dtype}{list(shape)} needs {want}")
        tensors[name] = (dtype, tuple(shape), b, e)
    pos = 0
    for name, (_, _, b, e) in sorted(tensors.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        if b != pos:
            raise SourceError(f"{path}: tensor {name!r} starts at {b}, expected {pos} (hole or overlap)")
        pos = e
    if pos != data_len:
        raise SourceError(f"{path}: tensors cover {pos} bytes but the data area is {data_len}")
    return 8 + n, tensors


def read_header(path: str) -> tuple[int, dict]:
    with open(path, "rb") as f:
        file_len = os.fstat(f.fileno()).st_size
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        if 0 < n <= MAX_HEADER:
            head += f.read(n)
    return parse_header(path, head, file_len)


def shard_files(path: str) -> tuple[list[str], dict[str, str] | None]:
    """The shard files of a checkpoint, sorted, and the index's tensor -> shard path map
    (None without an index)."""
    if os.path.isfile(path):
        if path.endswith(".json"):
            return index_shards(path)
        return [path], None
    index = os.path.join(path, INDEX_NAME)
    if os.path.exists(index):
        return index_shards(index)
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single], None
    found = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    if not found:
        raise SourceError(f"{path}: no {INDEX_NAME}, model.safetensors or *.safetensors")
    return found, None


def index_shards(index: str) -> tuple[list[str], dict[str, str]]:
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        names = sorted(set(weight_map.values()))
        for n in names:
            if not isinstance(n, str) or not n or "/" in n or n in (".", ".."):
                raise ValueError(f"shard name {n!r} is not a file name beside the index")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise SourceError(f"{index}: not a usable safetensors index ({e})") from None
    base = os.path.dirname(index)
    shards = [os.path.join(base, n) for n in names]
    for s in shards:
        if not os.path.exists(s):
            raise SourceError(f"{index}: shard {os.path.basename(s)} is missing")
    return shards, {t: os.path.join(base, n) for t, n in weight_map.items()}


def read_config(path: str) -> dict | None:
    """``config.json`` beside the checkpoint (None if there is none); malformed is a SourceError."""
    base = path if os.path.isdir(path) else os.path.dirname(path)
    cfg = os.path.join(base, CONFIG_NAME)
    if not os.path.isfile(cfg):
        return None
    try:
        with open(cfg, "rb") as f:
            data = json.loads(f.read(MAX_HEADER))
    except (OSError, ValueError) as e:
        raise SourceError(f"{cfg}: not a usable config.json ({e})") from None
    return data if isinstance(data, dict) else None


def detect_tensor_format(layout) -> str:
    """Which quantized byte layout the expert tensors use (``k3client.mxfp4`` decodes the MXFP4 ones).

    - ``ocp:MXFP4``: every ``X.weight_packed`` U8 ``[..., n]`` has its E8M0 ``X.weight_scale``
      U8 ``[..., n / 16]`` (OCP / compressed-tensors);
    - ``gpt-oss:MXFP4``: every ``X_blocks`` U8 ``[..., G, 16]`` has its E8M0 ``X_scales`` U8
      ``[..., G]`` (openai/gpt-oss as shipped; decode with ``layout="gpt-oss"``);
    - ``fp8:E4M3``: F8_E4M3 weights, each ``X.weight`` with ``X.weight_scale_inv`` F32 (one
      scale per 128 x 128 block; DeepSeek-V3 as shipped);
    - ``raw``: anything else; the tensors are what their dtypes say."""
    specs = {t.name: t for t in layout}
    packed = [n for n in specs if n.endswith(".weight_packed")]
    if packed:
        for name in packed:
            p, sc = specs[name], specs.get(name[: -len("packed")] + "scale")
            if (sc is None or p.dtype != "U8" or sc.dtype != "U8" or p.shape[:-1] != sc.shape[:-1]
                    or p.shape[-1] != sc.shape[-1] * 16):
                return "raw"
        return "ocp:MXFP4"
    blocks = [n for n in specs if n.endswith("_blocks")]
    if blocks:
        for name in blocks:
            b, sc = specs[name], specs.get(name[: -len("blocks")] + "scales")
            if (sc is None or b.dtype != "U8" or sc.dtype != "U8" or len(b.shape) < 2 or b.shape[-1] != 16
                    or b.shape[:-1] != sc.shape):
                return "raw"
        return "gpt-oss:MXFP4"
    fp8 = [n for n, t in specs.items() if t.dtype == "F8_E4M3"]
    if fp8 and all(n + "_scale_inv" in specs for n in fp8):
        return "fp8:E4M3"
    return "raw"


class SafetensorsSource(Source):
    """A safetensors checkpoint; experts found by ``pattern`` if given, else by the family rules."""

    kind = "safetensors"

    def __init__(self, path: str, pattern: str | None = None):
        super().__init__()
        self.path = path
        if pattern:
            pattern_rule(pattern)               # a malformed pattern fails before any file is read
        config = read_config(path)
        shards, owner = shard_files(path)
        tensors: list[tuple[str, tuple]] = []          # (name, (dtype, shape, file, offset, nbytes))
        for fi, shard in enumerate(shards):
            try:
                start, found = read_header(shard)
            except OSError as e:                # a directory named *.safetensors, EIO, EACCES
                raise SourceError(f"{shard}: cannot read ({e.strerror or e})") from None
            self.files.append(shard)
            for tname, (dtype, shape, b, e) in found.items():
                if owner is not None and owner.get(tname, shard) != shard:
                    continue                    # a stale copy the index does not use
                tensors.append((tname, (dtype, shape, fi, start + b, e - b)))
        self.family = fam = settle(path, config, (n for n, _ in tensors), pattern)
        hint = "" if owner is not None else " or name one in " + INDEX_NAME
        experts = expert_pieces(path, fam, tensors, itemsize, [os.path.basename(f) for f in shards], hint)
        if owner is not None:
            have = {n for n, _ in tensors}
            lost = sorted(t for t in owner if fam.rule.regex.match(t) and t not in have)
            if lost:
                raise SourceError(f"{path}: the index puts tensor {lost[0]!r} in {os.path.basename(owner[lost[0]])}, "
                                  f"which does not hold it ({len(lost)} such tensor(s))")
        if not experts:
            raise SourceError(f"{path}: no tensor matches the pattern {pattern!r}; "
                              + no_match_hint(n for n, _ in tensors))
        self.set_experts(path, experts)
        for f in self.files:
            try:
                self.fds.append(os.open(f, os.O_RDONLY | os.O_CLOEXEC))
            except OSError as e:
                self.close()                    # the fds opened so far
                raise SourceError(f"{f}: cannot open ({e.strerror or e})") from None
        self.tensor_format = detect_tensor_format(self.layout)
