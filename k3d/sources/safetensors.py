"""Local safetensors checkpoints: one file, or an index.json plus shards.

File format (parsed by hand, with the reference reader's limits)::

    [u64 little-endian N][N bytes JSON header][data ...]
    header: {"__metadata__": {...}?, name: {"dtype", "shape", "data_offsets": [b, e]}, ...}
    tensor bytes = file[8 + N + b : 8 + N + e]

Checks, each a SourceError naming the file and tensor: N <= 100,000,000 and
8 + N <= file length; the header is a JSON object; every tensor's dtype is
known, ``e - b == prod(shape) * itemsize``, offsets are in bounds; the tensors
cover the data area without holes or overlaps (as the reference requires).

Names map to keys with ``pattern`` (``{layer}``, ``{expert}``, ``{name}``); names
that do not match (attention, norms, the router) are ignored.  With an index,
a tensor is read from the shard its ``weight_map`` names (a copy elsewhere is
stale and ignored; a mapped tensor missing from its shard is an error);
without one, a tensor in two shards is an error, as are two names that map to
one expert tensor (``layers.1`` and ``layers.01``).  The layout is the
``{name}`` set of the lowest key (normally (0, 0)) in sorted order; every other
expert must have the same names, dtypes and shapes, or start-up fails naming
the first that differs.

Thread: built on the main thread (headers parsed there); read-only after;
``read`` (the base class's preadv) runs on many reader threads at once.
"""

from __future__ import annotations

import json
import math
import os
import re

from k3client.layout import DTYPES, build_layout

from .base import Extent, Source, SourceError

MAX_HEADER = 100_000_000
INDEX_NAME = "model.safetensors.index.json"


def compile_pattern(pattern: str) -> re.Pattern:
    for field in ("{layer}", "{expert}", "{name}"):
        if pattern.count(field) != 1:
            raise SourceError(f"pattern {pattern!r} must contain {field} exactly once")
    rx = re.escape(pattern)
    rx = rx.replace(re.escape("{layer}"), r"(?P<layer>\d+)")
    rx = rx.replace(re.escape("{expert}"), r"(?P<expert>\d+)")
    rx = rx.replace(re.escape("{name}"), r"(?P<name>.+)")
    return re.compile(rx + r"\Z")


def parse_header(path: str, raw_prefix: bytes, file_len: int) -> tuple[int, dict]:
    """Validate a safetensors header; returns (data_start, {name: (dtype, shape, b, e)})."""
    if len(raw_prefix) < 8 or file_len < 8:
        raise SourceError(f"{path}: too short to be a safetensors file ({file_len} bytes)")
    n = int.from_bytes(raw_prefix[:8], "little")
    if n > MAX_HEADER:
        raise SourceError(f"{path}: header size {n} exceeds the {MAX_HEADER} byte limit")
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


def detect_tensor_format(layout) -> str:
    """``ocp:MXFP4`` when every ``X.weight_packed`` has its E8M0 ``X.weight_scale``.

    The OCP / gpt-oss / compressed-tensors layout: U8 ``[..., n]`` packed nibbles
    (two elements a byte) and U8 ``[..., n / 16]`` scales (one per 32 elements).
    Anything else is ``raw``: the tensors are what their dtypes say."""
    specs = {t.name: t for t in layout}
    packed = [n for n in specs if n.endswith(".weight_packed")]
    if not packed:
        return "raw"
    for name in packed:
        p, sc = specs[name], specs.get(name[: -len("packed")] + "scale")
        if (sc is None or p.dtype != "U8" or sc.dtype != "U8" or p.shape[:-1] != sc.shape[:-1]
                or p.shape[-1] != sc.shape[-1] * 16):
            return "raw"
    return "ocp:MXFP4"


class SafetensorsSource(Source):
    kind = "safetensors"

    def __init__(self, path: str, pattern: str):
        super().__init__()
        self.path = path
        rx = compile_pattern(pattern)
        shards, owner = shard_files(path)
        experts: dict[tuple[int, int], dict[str, tuple]] = {}
        for fi, shard in enumerate(shards):
            try:
                start, tensors = read_header(shard)
            except OSError as e:                # a directory named *.safetensors, EIO, EACCES
                raise SourceError(f"{shard}: cannot read ({e.strerror or e})") from None
            self.files.append(shard)
            for tname, (dtype, shape, b, e) in tensors.items():
                m = rx.match(tname)
                if not m or (owner is not None and owner.get(tname, shard) != shard):
                    continue                    # not an expert, or a stale copy the index does not use
                key, name = (int(m["layer"]), int(m["expert"])), m["name"]
                have = experts.setdefault(key, {})
                if name in have:
                    other, other_fi = have[name][5], have[name][2]
                    raise SourceError(
                        f"{path}: tensors {other!r} ({os.path.basename(shards[other_fi])}) and {tname!r} "
                        f"({os.path.basename(shard)}) are both tensor {name!r} of expert (layer {key[0]}, "
                        f"expert {key[1]}); remove one{' or name one in ' + INDEX_NAME if owner is None else ''}")
                have[name] = (dtype, shape, fi, start + b, e - b, tname)
        if owner is not None:
            found = {v[5] for per in experts.values() for v in per.values()}
            lost = sorted(t for t in owner if rx.match(t) and t not in found)
            if lost:
                raise SourceError(f"{path}: the index puts tensor {lost[0]!r} in {os.path.basename(owner[lost[0]])}, "
                                  f"which does not hold it ({len(lost)} such tensor(s))")
        if not experts:
            raise SourceError(f"{path}: no tensor matches the pattern {pattern!r}")
        ref_key = min(experts)
        ref = experts[ref_key]
        self.layout = build_layout([(n, d, s, nb) for n, (d, s, _, _, nb, _) in ref.items()])
        want = {n: (d, s) for n, (d, s, *_rest) in ref.items()}
        for key in sorted(experts):
            have = experts[key]
            got = {n: (d, s) for n, (d, s, *_rest) in have.items()}
            if got != want:
                raise SourceError(self._mismatch(key, ref_key, want, got))
            self.keys[key] = [Extent(fi, off, spec.offset, nb)      # an empty tensor: nothing to read
                              for spec in self.layout
                              for (_, _, fi, off, nb, _) in [have[spec.name]] if nb]
        for f in self.files:
            try:
                self.fds.append(os.open(f, os.O_RDONLY | os.O_CLOEXEC))
            except OSError as e:
                self.close()                    # the fds opened so far
                raise SourceError(f"{f}: cannot open ({e.strerror or e})") from None
        self.tensor_format = detect_tensor_format(self.layout)

    @staticmethod
    def _mismatch(key, ref_key, want, got) -> str:
        where = f"expert (layer {key[0]}, expert {key[1]})"
        missing = sorted(set(want) - set(got))
        extra = sorted(set(got) - set(want))
        if missing:
            return f"{where} lacks tensor {missing[0]!r} that expert {ref_key} has"
        if extra:
            return f"{where} has tensor {extra[0]!r} that expert {ref_key} lacks"
        name = next(n for n in sorted(want) if want[n] != got[n])
        return (f"{where} tensor {name!r} is {got[name][0]}{list(got[name][1])}, "
                f"expert {ref_key} has {want[name][0]}{list(want[name][1])}")
