"""The daemon's side of the shared index (layout and proof: ``k3client.index``).

A sealed memfd of ``index_bytes(layers, width)`` bytes: the daemon keeps the one
writable mapping, clients receive the fd with the arena's and can only map it
PROT_READ (``F_SEAL_FUTURE_WRITE``), so no client can change what another reads.

Writes follow the seqlock order the readers rely on: ``seq`` odd, ``word``,
``seq`` even; an unpublish then bumps the header's ``retired`` count.  The loop
writes each key's entry through a ``memoryview`` of native 64-bit words (the
layout's little-endian ``<u8`` on every host k3d runs on: checked at creation),
~2x cheaper per store than a numpy element, and a key's entry changes three
times per read it costs (loading, ready, cleared).

Thread: the server thread (through ``Store``); no other writer exists.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import sys
from typing import Any

import numpy as np

from k3client.index import CLOSED, HEADER_WORDS, LOADING, MAGIC, READY, RETIRED, VERSION, index_bytes

F_SEAL_FUTURE_WRITE = 0x0010


class SharedIndex:
    def __init__(self, layers: int, width: int) -> None:
        self.layers, self.width = layers, width
        self.size = index_bytes(layers, width)
        self.fd: int | None = os.memfd_create("k3d-index", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.size)
            self._mm = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
        except BaseException:
            os.close(self.fd)
            raise
        self._words: Any = np.frombuffer(self._mm, dtype="<u8")
        self._words[:4] = (MAGIC, VERSION, layers, width)
        if sys.byteorder != "little":
            raise RuntimeError("the shared index is little-endian 64-bit words; this host is big-endian")
        self._bytes = memoryview(self._mm)
        self._q = self._bytes.cast("Q")          # the same words, natively (see the docstring)

    def _set(self, key, word: int) -> None:
        q, i = self._q, HEADER_WORDS + 2 * (key[0] * self.width + key[1])
        seq = q[i]
        q[i] = seq + 1
        q[i + 1] = word
        q[i] = seq + 2

    def loading(self, key, slot: int) -> None:
        self._set(key, slot << 2 | LOADING)

    def ready(self, key, slot: int) -> None:
        self._set(key, slot << 2 | READY)

    def clear(self, key) -> None:
        self._set(key, 0)
        self._q[RETIRED] += 1

    def retired(self) -> int:
        """The header's count of unpublished entries (``Store.check``: equal to ``Reuse.retired``)."""
        return self._q[RETIRED]

    def close(self) -> None:
        """Tell the clients that still map it that this daemon stopped, and let go of it."""
        if self._words is not None:
            self._words[CLOSED] = 1
        self._words = None
        self._q.release()
        self._bytes.release()
        try:
            self._mm.close()
        except BufferError:
            pass
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class NoIndex:
    """The store's index when nothing reads one (replay, unit tests)."""

    def loading(self, key, slot: int) -> None:
        pass

    def ready(self, key, slot: int) -> None:
        pass

    def clear(self, key) -> None:
        pass

    def retired(self) -> None:
        return None
