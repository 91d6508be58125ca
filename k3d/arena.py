"""The shared arena: one sealed memfd of fixed-size slots.

Memory layout::

    memfd "k3d-arena", size = slots * slot_bytes
    +-----------+-----------+-----+----------------+
    | slot 0    | slot 1    | ... | slot slots-1   |      slot_bytes = align(expert_bytes, 4096)
    +-----------+-----------+-----+----------------+
    slot s, tensor t  at  s * slot_bytes + layout[t].offset

Lifetime and protection:
- Created, reserved (``posix_fallocate``: a /dev/shm or memory shortage is a
  clear error at start, never a SIGBUS later), pre-faulted and sealed by the
  daemon alone.  Seals: SHRINK, GROW, FUTURE_WRITE, SEAL.  FUTURE_WRITE keeps
  the daemon's existing writable mapping but makes the kernel refuse every new
  writable mapping, so clients (who get the fd over a Unix socket) can only map
  it PROT_READ: a buggy client cannot corrupt what the others read.
- A memfd has no name in /dev/shm: when the daemon exits, even by ``kill -9``,
  the memory is freed as soon as the last client mapping goes.  Nothing is ever
  left behind to clean up.

Thread-safety: ``view(slot)`` may be used by reader threads to fill a slot the
server thread handed them; the server thread guarantees no two writers and no
reader of a loading slot.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import time

import numpy as np

PAGE = 4096
F_SEAL_FUTURE_WRITE = 0x0010
MADV_POPULATE_WRITE = 23


class ArenaError(Exception):
    pass


class Arena:
    def __init__(self, slots: int, slot_bytes: int, progress=None):
        if slots < 1:
            raise ArenaError("arena holds no slot")
        if slot_bytes % PAGE:
            raise ArenaError(f"slot size {slot_bytes} is not 4096-aligned")
        self.slots, self.slot_bytes = slots, slot_bytes
        self.size = slots * slot_bytes
        self.fd = os.memfd_create("k3d-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.size)
            try:
                os.posix_fallocate(self.fd, 0, self.size)
            except OSError as e:
                raise ArenaError(
                    f"cannot reserve a {self.size / 2**30:.2f} GiB arena in shared memory ({e.strerror}); "
                    "use a smaller --arena or free memory") from None
            self.mm = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
            self._prefault(progress)
            self._view = memoryview(self.mm)
        except BaseException:
            self.close()
            raise

    def _prefault(self, progress):
        """Touch every page now: first-touch faults are slow here (~1 GB/s)."""
        chunk = 256 * 2**20
        t0 = time.monotonic()
        pages = np.frombuffer(self.mm, dtype=np.uint8)
        for off in range(0, self.size, chunk):
            n = min(chunk, self.size - off)
            try:
                self.mm.madvise(MADV_POPULATE_WRITE, off, n)
            except OSError:
                pages[off:off + n:PAGE] = 0
            if progress:
                progress(off + n, self.size, time.monotonic() - t0)
        del pages

    def view(self, slot: int) -> memoryview:
        """Writable view of one slot (daemon side only)."""
        base = slot * self.slot_bytes
        return self._view[base:base + self.slot_bytes]

    def close(self):
        v = getattr(self, "_view", None)
        if v is not None:
            v.release()
            self._view = None
        mm = getattr(self, "mm", None)
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass
            self.mm = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
