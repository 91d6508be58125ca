"""The shared arena: one sealed memfd of fixed-size slots.

Memory layout::

    memfd "k3d-arena", size = slots * slot_bytes rounded up to whole huge pages
                       where they back it (memfd_bytes(); under 2 MiB of slack)
    +-----------+-----------+-----+----------------+
    | slot 0    | slot 1    | ... | slot slots-1   |      slot_bytes = align(expert_bytes, 4096)
    +-----------+-----------+-----+----------------+
    slot s, tensor t  at  s * slot_bytes + layout[t].offset

Lifetime and protection:
- Created, reserved (``posix_fallocate`` over every page: a memory shortage
  is a clear error at start, never a SIGBUS or an OOM kill later) and sealed by
  the daemon alone, before ready; pre-faulted after ready (``prepare``, below).
  Seals: SHRINK, GROW, FUTURE_WRITE, SEAL.  FUTURE_WRITE keeps
  the daemon's existing writable mapping but makes the kernel refuse every new
  writable mapping, so clients (who get the fd over a Unix socket) can only map
  it PROT_READ: a buggy client cannot corrupt what the others read.
- A memfd has no name in /dev/shm: when the daemon exits, even by ``kill -9``,
  the memory is freed as soon as the last client mapping goes.  Nothing is ever
  left behind to clean up.

Huge pages (``--hugepages``): the memfd is ``MFD_HUGETLB`` (the default huge
page size, 2 MiB on x86-64), its size rounded up to whole huge pages; slots
keep their 4096-aligned stride inside it.  Seals and the clients' read-only
mapping work as above.  Why: an O_DIRECT read into the arena is as fast as its
pages are physically contiguous (a virtio request carries a bounded number of
segments: bench/README.md, "huge pages"), and 4 KiB shmem pages are contiguous or
not by the luck of the free lists; huge pages are contiguous by construction.  They come from the
pool the administrator reserved (``vm.nr_hugepages``), are not charged to the
memory cgroup and are never swapped.

Transparent huge pages (the default without ``--hugepages``; ``thp = false``
turns it off): before the memfd is reserved, its whole 2 MiB regions are
collapsed into transparent huge pages (``k3d/memory/thp.py``) from offset 0 up
while that is cheaper than reserving them in 4 KiB pages, which gives the same
physical contiguity from ordinary memory; the rest is reserved in 4 KiB pages
and collapsed after ready, best effort.  ``thp_bytes`` is how much of the memfd
(slack included) is in huge pages so far, ``thp_why`` why not all ("" when all
was, or while the preparer may still collapse the rest).  Mappings and seals are
unchanged.

Order and invariant: ``Arena()`` returns with every page of the memfd reserved
and sealed, the cheap huge pages collapsed, nothing pre-faulted: every byte
reads and writes correctly from then on.  ``prepare(on_done)`` (the daemon
calls it once ready) starts ``k3d.memory.prepare.Preparer``: the remaining
collapse, then the pre-fault of the daemon's mapping, 64 MiB at a time from
offset 0, while slots are filled and served; ``prepare_status()`` says how far
it is.  Until it has passed a slot, the first write into that slot takes its
page faults (minor faults: the pages exist).  ``close()`` stops it first.

Thread-safety: ``view(slot)`` may be used by reader threads to fill a slot the
server thread handed them; the server thread guarantees no two writers and no
reader of a loading slot.  The preparer thread never writes a byte (collapse
copies pages in the kernel, pre-fault maps them), so it needs no slot.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import time

from k3d.memory.prepare import Preparer
from k3d.memory.thp import Collapser, region_bytes, reserve_seconds
from k3d.sizes import show_size

PAGE = 4096
F_SEAL_FUTURE_WRITE = 0x0010
RESERVE_STEP = 64 * 2**20    # progress every 64 MiB: ~10 % steps from a 640 MiB arena up


class ArenaError(Exception):
    pass


def hugepages() -> tuple[int, int]:
    """(default huge page size in bytes, huge pages free for a new reservation) from /proc/meminfo."""
    info = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                info[k] = int(v.split()[0])
    except (OSError, ValueError, IndexError):
        return 0, 0
    return info.get("Hugepagesize", 0) * 1024, info.get("HugePages_Free", 0) - info.get("HugePages_Rsvd", 0)


def memfd_bytes(size: int, huge: bool, thp: bool) -> int:
    """The arena memfd's size for ``size`` bytes of slots: whole pages, and where huge
    pages will back it, whole huge pages (so the last slot's tail can be one too)."""
    unit = hugepages()[0] if huge else max(PAGE, region_bytes() if thp else 0)
    unit = unit or PAGE
    return -(-size // unit) * unit


class Arena:
    def __init__(self, slots: int, slot_bytes: int, progress=None, huge: bool = False, thp: bool = True):
        """``progress(done, total, seconds, what)`` is called while the memory is prepared."""
        if slots < 1:
            raise ArenaError("arena holds no slot")
        if slot_bytes % PAGE:
            raise ArenaError(f"slot size {slot_bytes} is not 4096-aligned")
        self.slots, self.slot_bytes = slots, slot_bytes
        self.size = slots * slot_bytes
        self.page_bytes = hugepages()[0] if huge else PAGE
        if not self.page_bytes:
            raise ArenaError("--hugepages: this kernel has no huge pages (no Hugepagesize in /proc/meminfo)")
        self.mapped = memfd_bytes(self.size, huge, thp)      # the memfd's size, mapped by the daemon
        flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | (os.MFD_HUGETLB if huge else 0)
        try:
            self.fd = os.memfd_create("k3d-arena", flags)
        except OSError as e:
            raise ArenaError(f"cannot create the arena's memfd ({e.strerror})") from None
        self.preparer = None
        collapser = None
        try:
            os.ftruncate(self.fd, self.mapped)
            first, why = 0, "off" if not thp or huge else ""
            if thp and not huge:
                collapser = Collapser(self.fd, self.mapped)
                tick = (lambda d, t, sec: progress(d, t, sec, "collapsing")) if progress else None
                try:
                    first, why = collapser.front(self.fd, self.mapped, reserve_seconds(self.mapped), tick)
                except OSError as e:
                    # a region's first page does not fit: the full reservation below says why
                    first, why = 0, e.strerror
                if not collapser.whole:
                    collapser.close()           # nothing this kernel will collapse, now or later
                    collapser = None
                elif first < collapser.whole:
                    why = ""                    # the rest: after ready
            self._reserve(progress, huge)
            self.mm = mmap.mmap(self.fd, self.mapped, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
            self._view = memoryview(self.mm)
            self.preparer = Preparer(self.mm, self.mapped, collapser, first, why)
            collapser = None                    # the preparer's now (it closes it)
        except BaseException:
            if collapser is not None:
                collapser.close()
            self.close()
            raise

    @property
    def thp_bytes(self) -> int:
        """Bytes of the memfd in transparent huge pages so far."""
        return self.preparer.thp_bytes if self.preparer is not None else 0

    @property
    def thp_why(self) -> str:
        """Why not all of it (so far: "" while the preparer may still collapse the rest)."""
        return self.preparer.thp_why if self.preparer is not None else ""

    def _reserve(self, progress, huge: bool):
        """Allocate every page not yet allocated, in steps (progress, and a stop between them)."""
        t0 = time.monotonic()
        for off in range(0, self.mapped, RESERVE_STEP):
            n = min(RESERVE_STEP, self.mapped - off)
            try:
                os.posix_fallocate(self.fd, off, n)
            except OSError as e:
                if huge:
                    free = hugepages()[1]
                    raise ArenaError(
                        f"cannot reserve {self.mapped // self.page_bytes} huge pages of {show_size(self.page_bytes)} "
                        f"for the arena ({free} free: {e.strerror}); raise vm.nr_hugepages or drop --hugepages"
                    ) from None
                raise ArenaError(
                    f"cannot reserve a {show_size(self.size)} arena in shared memory ({e.strerror}); "
                    "use a smaller --arena or free memory") from None
            if progress:        # may raise (a stop during start-up): the mapping must close then
                progress(off + n, self.mapped, time.monotonic() - t0, "reserving")

    def prepare(self, on_done=None) -> None:
        """Start the collapse of the rest and the pre-fault (``k3d.memory.prepare``); once."""
        self.preparer.on_done = on_done
        self.preparer.start()

    def prepare_status(self) -> dict:
        """``{"state": waiting|running|done|stopped, "done", "total", "seconds"}``."""
        return self.preparer.status()

    def view(self, slot: int) -> memoryview:
        """Writable view of one slot (daemon side only)."""
        base = slot * self.slot_bytes
        return self._view[base:base + self.slot_bytes]

    def close(self):
        p = getattr(self, "preparer", None)
        if p is not None:
            p.stop()                     # before anything it uses is unmapped
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
