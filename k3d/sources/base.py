"""Origins of expert bytes: the common interface and local pread.

A source knows, for every expert key ``(layer, expert)``, the list of
``Extent``s that fill its slot: ``(file, file_offset, slot_offset, length)``.
Readers split an expert's extents into parts (``k3d.reads.plan.split_extents``) so several
threads work on one expert, and each part is read by ``Source.read`` straight
into slot memory (``os.preadv`` scatters one file-contiguous range over the
slot's tensor buffers: adjacent tensors cost one syscall, no bounce buffer).

Remote origins (``http(s)://``, ``s3://``) live in ``remote/``, with their disk
tier; ``k3d.sources.open_source`` dispatches on the scheme and the magic.

Layouts: a layer's experts share one layout (``layouts[layer]``, built from its
lowest expert by ``set_experts``); layers may differ (a GGUF Q4_K_M mix, any
mixed-precision checkpoint).  ``layout`` is the lowest layer's, ``uniform`` says
whether every layer has it, and ``expert_bytes`` is the largest expert: the slot
size.  Sources that know a single layout set only ``layout`` (``layouts`` empty).

Family: ``family`` (name, rule, how it was matched, top-k) from
``k3d.sources.families``, or None for formats that carry no family (GGUF, packs).

Digest: ``digest`` is the content digest of what the source serves
(``k3d.sources.digest``: layout and sampled bytes of every expert tensor), set
once by the daemon at start-up before clients attach; ``describe`` includes it.

Invariants a subclass keeps: an expert's extents fill its slot's layout
ranges (one extent per non-empty tensor; a packed expert is one extent of its
whole stride, zero padding included) and never reach past ``expert_bytes``
rounded up to 4096; no extent is empty.

Thread: a source is built on the main thread; after construction it is
read-only; ``read`` is called from many reader threads at once (pread on a
shared fd is position-free).  Caller's obligation: ``close()`` on the main
thread once no read is running.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from k3client.digest import span_text  # (one rule for naming layers, client and daemon)
from k3client.layout import TensorSpec, build_layout, layout_bytes

PAGE = 4096


class SourceError(Exception):
    """The checkpoint cannot be served; the message names the file/tensor."""


@dataclass(frozen=True)
class Extent:
    file: int          # index into Source.files
    offset: int        # byte offset in that file
    slot_offset: int   # byte offset inside the slot
    length: int


class Source:
    """Base class: ``layout``, ``keys`` (key -> extents), ``files`` (paths)."""

    kind = "?"
    # How many parts one expert's read may be split into so several readers
    # share it: local preads gain from it; a remote origin wants one request
    # per expert (one coalesced range), so remote sources set 1.
    max_parts = 8

    def __init__(self):
        self.layout: list[TensorSpec] = []
        self.layouts: dict[int, list[TensorSpec]] = {}
        self.keys: dict[tuple[int, int], list[Extent]] = {}
        self.files: list[str] = []
        self.fds: list[int] = []
        self.identities = None        # each file's identity as opened (open_source; k3d.sources.identity)
        self.tensor_format = "raw"
        self.tensor_types: dict[str, str] = {}
        self.layer_tensor_types: dict[int, dict[str, str]] = {}
        self.family = None            # k3d.sources.families.Family, where the format has one
        self.family_fields: dict = {}   # a pack's record of its source's family (describe's fields)
        self.digest: dict | None = None   # k3d.sources.digest.for_source's, set once at start-up

    @property
    def expert_bytes(self) -> int:
        """Bytes of the largest expert (every slot holds this many)."""
        return max([layout_bytes(self.layout)] + [layout_bytes(l) for l in self.layouts.values()])

    def layout_of(self, layer: int) -> list[TensorSpec]:
        return self.layouts.get(layer, self.layout)

    @property
    def uniform(self) -> bool:
        """Every layer has ``layout`` (and the same tensor types): one layout tells all."""
        return (all(lay == self.layout for lay in self.layouts.values())
                and all(t == self.tensor_types for t in self.layer_tensor_types.values()))

    def adopt(self, other: Source) -> None:
        """Take another source's experts as this one's (remote sources parse a header image)."""
        self.layout, self.layouts, self.keys = other.layout, other.layouts, other.keys
        self.tensor_format, self.family = other.tensor_format, other.family
        self.family_fields = dict(other.family_fields)
        self.tensor_types = dict(getattr(other, "tensor_types", None) or {})
        self.layer_tensor_types = dict(other.layer_tensor_types)

    def layout_groups(self) -> list[list]:
        """``[[layers], [TensorSpec wire...], {name: tensor type}]`` per distinct layer layout, lowest first."""
        groups: dict[str, list] = {}
        for layer in sorted(self.layouts) or sorted({l for l, _ in self.keys}):
            spec = self.layout_of(layer)
            types = self.layer_tensor_types.get(layer, self.tensor_types)
            sig = repr((spec, sorted(types.items())))
            groups.setdefault(sig, [[], [s.to_wire() for s in spec], dict(types)])[0].append(layer)
        return list(groups.values())

    def describe(self) -> dict:
        layers = sorted({l for l, _ in self.keys})
        experts = sorted({e for _, e in self.keys})
        per_layer = {}
        for l, _ in self.keys:
            per_layer[l] = per_layer.get(l, 0) + 1
        d = {"kind": self.kind, "path": self.path, "layers": layers,
             "experts": experts[:1] + experts[-1:], "count": len(self.keys),
             "experts_per_layer": max(per_layer.values(), default=0),
             "expert_bytes": self.expert_bytes, "tensor_format": self.tensor_format,
             "family": self.family.name if self.family else None,
             "family_rule": f"{self.family.rule.id} ({self.family.how})" if self.family else None,
             "top_k": self.family.top_k if self.family else None}
        d.update(self.family_fields)
        if self.digest is not None:
            d["digest"] = self.digest
        if not self.uniform:
            d["layouts"] = self.layout_groups()
        return d

    def set_experts(self, where: str, experts: dict) -> None:
        """Layouts and extents from ``{(layer, expert): {name: (dtype, shape, file, offset, nbytes, tensor)}}``.

        Each layer's layout is its lowest expert's tensors in sorted name order; every other
        expert of the layer must have the same names, dtypes and shapes (SourceError naming
        the first that differs)."""
        by_layer: dict[int, list[tuple[int, int]]] = {}
        for key in sorted(experts):
            by_layer.setdefault(key[0], []).append(key)
        for layer, keys in by_layer.items():
            ref_key = keys[0]
            ref = experts[ref_key]
            layout = build_layout([(n, d, s, nb) for n, (d, s, _, _, nb, _) in ref.items()])
            want = {n: (d, tuple(s)) for n, (d, s, *_rest) in ref.items()}
            for key in keys:
                have = experts[key]
                got = {n: (d, tuple(s)) for n, (d, s, *_rest) in have.items()}
                if got != want:
                    raise SourceError(f"{where}: " + expert_mismatch(key, ref_key, want, got))
                self.keys[key] = [Extent(fi, off, spec.offset, nb)      # an empty tensor: nothing to read
                                  for spec in layout
                                  for (_, _, fi, off, nb, _) in [have[spec.name]] if nb]
            self.layouts[layer] = layout
        self.layout = self.layouts[min(self.layouts)] if self.layouts else []

    def unknown(self, key) -> str:
        d = self.describe()
        return (f"unknown expert (layer {key[0]}, expert {key[1]}): {self.path} has layers "
                f"{span_text(d['layers'])}, experts {d['experts'][0]}-{d['experts'][-1]}")

    def read(self, extents: list[Extent], slot: memoryview) -> int:
        """Fill ``slot`` at the extents' slot offsets; returns bytes read."""
        return preadv_extents(self.fds, extents, slot)

    def close(self):
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def expert_mismatch(key, ref_key, want, got) -> str:
    """Why expert ``key``'s {name: (dtype, shape)} is not ``ref_key``'s (its layer's layout)."""
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


def read_fully(fd: int, buffers: list[memoryview], offset: int, what: str, flags: int = 0) -> int:
    """``os.preadv`` until every buffer is full; a short file is an error.  ``flags``:
    ``preadv2``'s (``os.RWF_NOWAIT``: BlockingIOError where a page is not cached)."""
    total = 0
    while buffers:
        n = os.preadv(fd, buffers, offset, flags) if flags else os.preadv(fd, buffers, offset)
        if n == 0:
            raise OSError(f"{what}: unexpected end of file at offset {offset}")
        total += n
        offset += n
        while buffers and n >= len(buffers[0]):
            n -= len(buffers[0])
            buffers.pop(0)
        if buffers and n:
            buffers[0] = buffers[0][n:]
    return total


def contiguous_runs(extents, slot: memoryview, max_buffers: int = 512):
    """Yield ``(file, offset, buffers)``: file-contiguous extents merged into one
    read that scatters over their slot buffers (one preadv / one HTTP range)."""
    ext = sorted(extents, key=lambda x: (x.file, x.offset))
    i = 0
    while i < len(ext):
        first = ext[i]
        bufs = [slot[first.slot_offset:first.slot_offset + first.length]]
        end = first.offset + first.length
        j = i + 1
        while j < len(ext) and ext[j].file == first.file and ext[j].offset == end and len(bufs) < max_buffers:
            e = ext[j]
            bufs.append(slot[e.slot_offset:e.slot_offset + e.length])
            end += e.length
            j += 1
        yield first.file, first.offset, bufs
        i = j


def preadv_extents(fds, extents, slot: memoryview) -> int:
    """Read extents, merging file-contiguous ones into one preadv (IOV_MAX is 1024)."""
    return sum(read_fully(fds[f], bufs, off, f"file #{f}") for f, off, bufs in contiguous_runs(extents, slot))
