"""The daemon's side of the shared index (layout and proof: ``k3client.index``).

A sealed memfd of ``index_bytes(layers, width)`` bytes: the daemon keeps the one
writable mapping, clients receive the fd with the arena's and can only map it
PROT_READ (``F_SEAL_FUTURE_WRITE``), so no client can change what another reads.

Writes follow the seqlock order the readers rely on: ``seq`` odd, ``word``,
``seq`` even; an unpublish then bumps the header's ``retired`` count.

Thread: the server thread (through ``Store``); no other writer exists.
"""

from __future__ import annotations

import fcntl
import mmap
import os

import numpy as np

from k3client.index import CLOSED, HEADER_WORDS, LOADING, MAGIC, READY, RETIRED, VERSION, index_bytes

F_SEAL_FUTURE_WRITE = 0x0010


class SharedIndex:
    def __init__(self, layers: int, width: int):
        self.layers, self.width = layers, width
        self.size = index_bytes(layers, width)
        self.fd = os.memfd_create("k3d-index", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.size)
            self._mm = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
        except BaseException:
            os.close(self.fd)
            raise
        self._words = np.frombuffer(self._mm, dtype="<u8")
        self._words[:4] = (MAGIC, VERSION, layers, width)
        entries = self._words[HEADER_WORDS:HEADER_WORDS + 2 * layers * width]
        self._seq, self._word = entries[0::2], entries[1::2]

    def _set(self, key, word: int) -> None:
        i = key[0] * self.width + key[1]
        seq = int(self._seq[i])
        self._seq[i] = seq + 1
        self._word[i] = word
        self._seq[i] = seq + 2

    def loading(self, key, slot: int) -> None:
        self._set(key, slot << 2 | LOADING)

    def ready(self, key, slot: int) -> None:
        self._set(key, slot << 2 | READY)

    def clear(self, key) -> None:
        self._set(key, 0)
        self._words[RETIRED] += 1

    def retired(self) -> int:
        """The header's count of unpublished entries (``Store.check``: equal to ``Reuse.retired``)."""
        return self._words[RETIRED]

    def close(self) -> None:
        """Tell the clients that still map it that this daemon stopped, and let go of it."""
        if self._words is not None:
            self._words[CLOSED] = 1
        self._seq = self._word = self._words = None
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
