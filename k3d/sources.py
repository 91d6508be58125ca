"""Origins of expert bytes: the common interface, local pread, and dispatch.

A source knows, for every expert key ``(layer, expert)``, the list of
``Extent``s that fill its slot: ``(file, file_offset, slot_offset, length)``.
Readers split an expert's extents into parts (``split_extents``) so several
threads work on one expert, and each part is read by ``Source.read`` straight
into slot memory (``os.preadv`` scatters one file-contiguous range over the
slot's tensor buffers: adjacent tensors cost one syscall, no bounce buffer).

Remote origins (``http(s)://``, ``s3://``) live in source_http.py / source_s3.py,
with their disk tier in disk_cache.py; ``open_source`` dispatches on the scheme.

Thread-safety: after construction a source is read-only; ``read`` is called from
many reader threads at once (pread on a shared fd is position-free).
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


def parts_per_key(readers: int, keys: int, max_parts: int) -> int:
    """Parts to cut each of ``keys`` experts read together into, so that ``readers``
    threads all have work (whole parts per reader: never more parts than readers)."""
    return max(1, min(max_parts, readers // keys))


def split_extents(extents: list[Extent], parts: int) -> list[list[Extent]]:
    """Cut extents into at most ``parts`` groups of about equal bytes (page-aligned cuts)."""
    total = sum(e.length for e in extents)
    if parts <= 1 or total <= PAGE:
        return [list(extents)]
    share = max(PAGE, (-(-total // parts) + PAGE - 1) // PAGE * PAGE)     # parts * share >= total
    out, cur, room = [], [], share
    for e in sorted(extents, key=lambda x: (x.file, x.offset)):
        off, so, left = e.offset, e.slot_offset, e.length
        while left:
            take = min(left, room)
            cur.append(Extent(e.file, off, so, take))
            off, so, left, room = off + take, so + take, left - take, room - take
            if room == 0:
                out.append(cur)
                cur, room = [], share
    if cur:
        out.append(cur)
    return out


def open_source(spec: str, pattern: str, read_mode: str = "buffered", cfg=None) -> Source:
    """Pick the source for a path (directory or file) or URL; raises SourceError.

    Files are recognised by their magic (``GGUF``, ``K3DPACK``), else by extension;
    ``read_mode`` (buffered | direct) applies to packed files, whose experts are
    4096-aligned; direct reads of other formats are refused.  ``http(s)://`` and
    ``s3://`` specs are remote sources (source_http.py, source_s3.py) configured
    from ``cfg`` (connections, timeouts, retries, the disk cache tier).
    """
    if spec.startswith(("http://", "https://", "s3://")):
        if read_mode == "direct":
            raise SourceError(f"--read-mode direct reads local packed files; {spec} is remote "
                              "(its disk cache tier reads buffered)")
        return open_remote(spec, pattern, cfg)
    from .packed import MAGIC as PACK_MAGIC, PARTIAL, PackedSource
    from .source_gguf import MAGIC as GGUF_MAGIC, GGUFSource
    from .source_safetensors import SafetensorsSource

    if not os.path.exists(spec):
        raise SourceError(f"checkpoint not found: {spec}")
    head = b""
    if os.path.isfile(spec):
        fd = os.open(spec, os.O_RDONLY | os.O_CLOEXEC)
        try:
            # no readahead: its window would leave a PG_readahead mark that later sets off
            # async readahead of expert pages the reads never asked for (see packed.py)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            head = os.pread(fd, 8, 0)
        finally:
            os.close(fd)
    if head == PACK_MAGIC or spec.endswith((".k3pack", PARTIAL)):   # PackedSource refuses a .partial
        return PackedSource(spec, read_mode)
    if read_mode not in ("buffered", "direct"):
        raise SourceError(f"unknown read mode {read_mode!r} (use buffered or direct)")
    if read_mode == "direct":
        raise SourceError(f"--read-mode direct needs a packed file (4096-aligned experts); "
                          f"convert {spec} with `k3d pack {spec} OUT.k3pack`")
    if head[:4] == GGUF_MAGIC or spec.endswith(".gguf"):
        return GGUFSource(spec)
    if os.path.isdir(spec) or spec.endswith(".safetensors") or spec.endswith(".json"):
        return SafetensorsSource(spec, pattern)
    raise SourceError(f"unsupported source {spec}: expected a safetensors directory or file, "
                      "a .gguf file or a .k3pack file")


def open_remote(spec: str, pattern: str, cfg=None) -> Source:
    """An HTTP(S) or S3 source; ``cfg`` (a Config, or None for defaults) supplies the tunables."""
    kw = {"disk_cache": getattr(cfg, "disk_cache", None),
          "disk_cache_size": getattr(cfg, "disk_cache_size", 16 * 2**30),
          "retries": getattr(cfg, "http_retries", 5)}
    conns, timeout = getattr(cfg, "http_conns", 4), getattr(cfg, "http_timeout", 30.0)
    if spec.startswith("s3://"):
        from .source_s3 import S3Source
        return S3Source(spec, pattern, conns=conns, timeout=timeout, **kw)
    from .source_http import HttpSource
    return HttpSource(spec, pattern, conns=conns, timeout=timeout, **kw)
