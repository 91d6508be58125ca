"""Transparent huge pages for the arena's memfd, with no reservation by the administrator.

Why: an O_DIRECT read into the arena is as fast as the slot's pages are
physically contiguous (a virtio request carries a bounded number of segments, so
scattered 4 KiB pages split a read into more requests; bench/README.md,
"huge pages"), and 4 KiB shmem pages are contiguous or not by the luck of the
free lists.  ``--hugepages`` fixes that with hugetlb pages, which someone must
reserve first; this module gets the same 2 MiB runs from ordinary memory.

How: ``MADV_COLLAPSE`` (Linux 6.1+) replaces the pages behind a range of a
mapping with PMD-sized folios; for a shmem file those folios belong to the
*file*, so every mapping of it, at any address (the daemon's own writable one,
the clients' read-only ones), reads and DMAs into the same 2 MiB runs, even
where it maps them with 4 KiB page-table entries.  MADV_COLLAPSE ignores the
sysfs THP policy except ``deny`` (it works with ``shmem_enabled`` at ``never``).
Its range must be mapped at a PMD-aligned address, which Python's ``mmap``
cannot ask for, so a ``Collapser`` maps the fd a second time through libc at an
aligned address inside a PROT_NONE reservation, collapses PMD region by PMD
region (to count what succeeded), and unmaps it on ``close``: no Python object
ever sees that mapping.

Memory layout: file offsets ``[k * pmd, (k + 1) * pmd)`` for whole regions
inside ``length`` become one huge folio each where the kernel finds a free
2 MiB block; the tail after the last whole region, and any region it could not
collapse, stay 4 KiB pages.  ``Collapser.front`` (before the file is reserved)
first gives each region it will try one 4 KiB page (``posix_fallocate``): a
region with no page cannot be collapsed, and one with all 512 is copied page by
page (several times slower; bench/README.md, "huge pages").  ``region`` on a
reserved region is that copy, and safe while the region is in use: the kernel
locks and unmaps its pages, copies them and maps the new folio in every mapping
(a writer or reader meanwhile waits on the folio lock); pages pinned by an
O_DIRECT read make it refuse with EAGAIN instead.

When: at start only while it is cheap.  A region the kernel has a free 2 MiB
block for costs an allocation and a zeroing (~0.1 s per GiB here, less than
reserving it in 4 KiB pages: ~0.3 s per GiB), but once it must reclaim or
compact for each region it costs ~2.5 s per GiB, and a 16 GiB arena spent
10-25 s that way on a 23 GiB VM (bench/README.md, "start-up at 16 GiB").  So
``front`` stops after the first 64 MiB step that took over ``SLOW`` x the
time reserving 64 MiB in 4 KiB pages takes in the same run
(``reserve_seconds``); the rest is reserved in 4 KiB pages and collapsed after
ready by ``k3d.memory.prepare``, best effort.

Best effort: on a kernel without MADV_COLLAPSE, with ``shmem_enabled=deny``,
or short of free 2 MiB blocks, fewer regions (or none) are collapsed and the
arena works exactly as before.  ``region_bytes()`` is 0 where no collapse will
be tried (no THP, ``deny``, or a PMD over 32 MiB, as arm64 with 64 KiB pages
has: 512 MiB regions would round an arena up too far), so callers size the
memfd with it (``k3d.memory.arena.memfd_bytes``).

The caller's obligations: create a ``Collapser`` before the memfd is sealed
against new writable mappings (its mapping is writable), reserve the rest of
the file after ``front`` (``posix_fallocate`` over the whole length) as for any
arena, and ``close`` it after its last ``region``.  Thread-safety: one thread
at a time per ``Collapser``; the second mapping lives inside an address range
reserved for it, so no other thread's mapping is touched.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import time

MADV_COLLAPSE = 25
MAP_FIXED = 0x10
PROT_NONE = 0
MAX_REGION = 32 << 20     # larger PMDs (arm64 with 64 KiB pages: 512 MiB) are not tried
STEP = 64 << 20           # progress, and the pace check, every 64 MiB
SLOW = 2                  # a step this many times its reservation's cost: leave the rest for later
_MAP_FAILED = ctypes.c_void_p(-1).value
_THP_SYSFS = "/sys/kernel/mm/transparent_hugepage"


def pmd_bytes() -> int:
    """The size of a PMD-mapped huge page (2 MiB on x86-64), or 0 where THP is not built in."""
    try:
        with open(f"{_THP_SYSFS}/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


def shmem_policy() -> str:
    """The selected word of ``shmem_enabled`` ("never", "deny", ...), or "" where absent."""
    try:
        with open(f"{_THP_SYSFS}/shmem_enabled") as f:
            text = f.read()
    except OSError:
        return ""
    return next((w[1:-1] for w in text.split() if w.startswith("[")), "")


def region_bytes() -> int:
    """The huge page size ``collapse`` will try, or 0 where it will not try at all."""
    pmd = pmd_bytes()
    if not pmd or pmd > MAX_REGION or shmem_policy() == "deny":
        return 0
    return pmd


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def reserve_seconds(most: int) -> float:
    """What reserving ``STEP`` bytes of shmem in 4 KiB pages takes here, now, measured on a
    scratch memfd of at most ``most`` bytes (the arena's own size: in a tight memory cgroup
    the scratch must fit where the arena was found to fit), closed again: the floor
    ``Collapser.front`` compares with."""
    length = max(mmap.PAGESIZE, min(STEP, most) // mmap.PAGESIZE * mmap.PAGESIZE)
    fd = os.memfd_create("k3d-floor", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, length)
        t = time.monotonic()
        os.posix_fallocate(fd, 0, length)
        return (time.monotonic() - t) * STEP / length
    finally:
        os.close(fd)


class Collapser:
    """A PMD-aligned writable mapping of the shmem file ``fd`` (``length`` bytes, already
    ftruncated) for collapsing it region by region, from any one thread at a time.

    Create it before the memfd is sealed against new writable mappings; it keeps its
    mapping (inside a reservation: no Python object sees it) until ``close``.  ``whole``
    is the bytes of whole regions (0 with ``why`` set where nothing can be tried)."""

    def __init__(self, fd: int, length: int):
        self.pmd, self.whole, self.why, self._reserve, self._start = region_bytes(), 0, "", None, 0
        if not self.pmd:
            self.why = ("this kernel has no transparent huge pages for shmem"
                        + (" (shmem_enabled is deny)" if shmem_policy() == "deny" else ""))
            return
        whole = length // self.pmd * self.pmd
        if not whole:
            self.why = f"the arena is smaller than one {self.pmd >> 20} MiB region"
            return
        self._libc = libc = _libc()
        # reserve whole + pmd of address space so an aligned start fits, then map the file there
        span = whole + self.pmd
        reserve = libc.mmap(None, span, PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if reserve in (None, _MAP_FAILED):
            self.why = "no address space for the collapse mapping"
            return
        start = -(-reserve // self.pmd) * self.pmd
        addr = libc.mmap(start, whole, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | MAP_FIXED, fd, 0)
        if addr != start:
            # a failed MAP_FIXED may have unmapped part of [start, start + whole) already, and
            # another thread may have mapped something there since: release only the head and
            # tail of the reservation (the rest leaks a PROT_NONE range, harmlessly)
            if start > reserve:
                libc.munmap(reserve, start - reserve)
            libc.munmap(start + whole, reserve + span - (start + whole))
            self.why = f"cannot map the arena for collapsing ({os.strerror(ctypes.get_errno())})"
            return
        self.whole, self._reserve, self._span, self._start = whole, reserve, span, start

    def region(self, off: int) -> int:
        """Collapse the region at file offset ``off``: 0, or the errno why not (EINVAL: this
        kernel cannot; EAGAIN: its pages are busy, e.g. pinned by an O_DIRECT read; ENOMEM:
        no free 2 MiB block)."""
        if self._libc.madvise(self._start + off, self.pmd, MADV_COLLAPSE) == 0:
            return 0
        return ctypes.get_errno() or errno.EIO

    def front(self, fd: int, length: int, floor: float | None = None, progress=None) -> tuple[int, str]:
        """Collapse the file's regions (not yet reserved) in order from offset 0, stopping at
        the first that fails, and, given ``floor`` (seconds to reserve a step of 64 MiB in 4 KiB
        pages: ``reserve_seconds``), after the first step that took over ``SLOW`` x that.
        Returns (bytes collapsed: one run from offset 0, why not all: "" when all were).

        ``progress(done, total, seconds)`` is called every 64 MiB of regions tried."""
        if not self.whole:
            return 0, self.why
        pmd, step = self.pmd, max(self.pmd, STEP // self.pmd * self.pmd)
        done, t0 = 0, time.monotonic()
        for lo in range(0, self.whole, step):
            hi, t = min(lo + step, self.whole), time.monotonic()
            for off in range(lo, hi, pmd):
                os.posix_fallocate(fd, off, mmap.PAGESIZE)   # one page per region: see the module docstring
            for off in range(lo, hi, pmd):
                err = self.region(off)
                if err:
                    if err == errno.EINVAL and off == 0:
                        self.whole = 0                  # this kernel cannot: nothing to try later
                    return done, why_failed(err, off == 0)
                done += pmd
            if progress:
                progress(hi, self.whole, time.monotonic() - t0)
            if floor is not None and hi < self.whole and time.monotonic() - t > SLOW * floor * (hi - lo) / STEP:
                return done, "the rest is left for later"     # the kernel now reclaims or compacts per region
        return done, f"the last {length - done} bytes are less than a region" if length > done else ""

    def close(self) -> None:
        if self._reserve is not None:
            self._libc.munmap(self._reserve, self._span)   # the file mapping lies inside: both go
            self._reserve = None


def why_failed(err: int, first: bool) -> str:
    """A region's collapse error in words (``first``: no region of this file was collapsed yet)."""
    if err == errno.EINVAL and first:
        return "this kernel cannot collapse shmem (MADV_COLLAPSE: Linux 6.1+)"
    return f"{os.strerror(err)} (memory fragmented or short)"


def collapse(fd: int, length: int, progress=None) -> tuple[int, str]:
    """``Collapser(fd, length).front()``, the mapping closed again: the whole file at once."""
    c = Collapser(fd, length)
    try:
        return c.front(fd, length, progress=progress)
    finally:
        c.close()
