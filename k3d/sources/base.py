"""Origins of expert bytes: the common interface and local pread.

A source knows, for every expert key ``(layer, expert)``, the list of
``Extent``s that fill its slot: ``(file, file_offset, slot_offset, length)``.
Readers split an expert's extents into parts (``k3d.reads.plan.split_extents``) so several
threads work on one expert, and each part is read by ``Source.read`` straight
into slot memory (``os.preadv`` scatters one file-contiguous range over the
slot's tensor buffers: adjacent tensors cost one syscall, no bounce buffer).

Remote origins (``http(s)://``, ``s3://``) live in ``remote/``, with their disk
tier; ``k3d.sources.open_source`` dispatches on the scheme and the magic.

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

from k3client.layout import TensorSpec, layout_bytes

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
        self.keys: dict[tuple[int, int], list[Extent]] = {}
        self.files: list[str] = []
        self.fds: list[int] = []
        self.tensor_format = "raw"

    @property
    def expert_bytes(self) -> int:
        return layout_bytes(self.layout)

    def describe(self) -> dict:
        layers = sorted({l for l, _ in self.keys})
        experts = sorted({e for _, e in self.keys})
        return {"kind": self.kind, "path": self.path, "layers": layers[:1] + layers[-1:],
                "experts": experts[:1] + experts[-1:], "count": len(self.keys),
                "tensor_format": self.tensor_format}

    def unknown(self, key) -> str:
        d = self.describe()
        return (f"unknown expert (layer {key[0]}, expert {key[1]}): {self.path} has layers "
                f"{d['layers'][0]}-{d['layers'][-1]}, experts {d['experts'][0]}-{d['experts'][-1]}")

    def read(self, extents: list[Extent], slot: memoryview) -> int:
        """Fill ``slot`` at the extents' slot offsets; returns bytes read."""
        return preadv_extents(self.fds, extents, slot)

    def close(self):
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def read_fully(fd: int, buffers: list[memoryview], offset: int, what: str) -> int:
    """``os.preadv`` until every buffer is full; a short file is an error."""
    total = 0
    while buffers:
        n = os.preadv(fd, buffers, offset)
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
