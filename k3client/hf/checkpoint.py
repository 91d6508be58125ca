"""Safetensors headers and lazy per-tensor reads that never touch other tensors' pages.

``safetensors.safe_open`` (0.8, mmap backend) populates the whole file when it
opens it, so it would read every routed expert of a single-file checkpoint.
Here a file's header is read with one ``pread`` (8 + N bytes), the fd is set
``POSIX_FADV_RANDOM`` (no readahead into neighbouring expert bytes), and a
``LazyTensor`` reads exactly its own byte range when transformers' loader
slices it (``tensor[...]``), the one operation it applies to ``get_slice``
objects (plus ``get_shape``/``get_dtype``).

Thread-safety: transformers materialises tensors on a thread pool; ``pread`` on
a shared fd is position-free.  ``Files.close`` after loading.
"""

from __future__ import annotations

import json
import os
import struct

import torch

from ..layout import DTYPES

HEADER_LIMIT = 100 << 20     # safetensors caps headers at 100 MB


class Files:
    """Open checkpoint files (read-only, no readahead), closed together."""

    def __init__(self):
        self.fds: dict[str, int] = {}

    def fd(self, path: str) -> int:
        if path not in self.fds:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            self.fds[path] = fd
        return self.fds[path]

    def header(self, path: str) -> tuple[dict, int]:
        """(``{name: {dtype, shape, data_offsets}}``, data start offset) of a safetensors file."""
        fd = self.fd(path)
        head = os.pread(fd, 8, 0)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > HEADER_LIMIT:
            raise ValueError(f"{path}: safetensors header of {n} bytes (corrupt?)")
        raw = os.pread(fd, n, 8)
        try:
            hdr = json.loads(raw)
        except ValueError as e:
            raise ValueError(f"{path}: unreadable safetensors header: {e}") from None
        hdr.pop("__metadata__", None)
        return hdr, 8 + n

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


class LazyTensor:
    """One tensor of a file, read (only its bytes) when sliced."""

    def __init__(self, files: Files, path: str, start: int, info: dict):
        self.files, self.path = files, path
        b, e = info["data_offsets"]
        self.offset, self.nbytes = start + b, e - b
        self.dtype, self.shape = info["dtype"], list(info["shape"])

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return self.dtype

    def _read(self):
        buf = bytearray(self.nbytes)
        view, off = memoryview(buf), self.offset
        fd = self.files.fd(self.path)
        while view:
            n = os.preadv(fd, [view], off)
            if n == 0:
                raise OSError(f"{self.path}: unexpected end of file at {off}")
            view, off = view[n:], off + n
        tdt = getattr(torch, DTYPES[self.dtype][2])
        if not buf:
            return torch.empty(self.shape, dtype=tdt)
        return torch.frombuffer(buf, dtype=tdt).reshape(self.shape)

    def __getitem__(self, index):
        return self._read()[index]
