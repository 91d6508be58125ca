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
cannot ask for, so ``collapse`` maps the fd a second time
through libc at an aligned address inside a PROT_NONE reservation, collapses
PMD region by PMD region (to count what succeeded), and unmaps it again: no
Python object ever sees that mapping.

Memory layout: file offsets ``[k * pmd, (k + 1) * pmd)`` for whole regions
inside ``length`` become one huge folio each where the kernel finds a free
2 MiB block (it compacts to make one); the tail after the last whole region,
and any region it could not collapse, stay 4 KiB pages.  Before collapsing,
each region gets one 4 KiB page (``posix_fallocate``): a region with no page
cannot be collapsed, and one with all 512 would be copied page by page (several
times slower; bench/README.md, "huge pages").

Best effort: on a kernel without MADV_COLLAPSE, with ``shmem_enabled=deny``,
or short of free 2 MiB blocks, fewer regions (or none) are collapsed and the
arena works exactly as before; after 8 regions in a row fail (memory too
fragmented: each failure may have compacted and reclaimed in vain) the rest is
left in 4 KiB pages rather than stretching start-up.  ``region_bytes()`` is
0 where no collapse will be tried (no THP, ``deny``, or a PMD over 32 MiB, as
arm64 with 64 KiB pages has: 512 MiB regions would round an arena up too far),
so callers size the memfd with it (``k3d.memory.arena.memfd_bytes``).

The caller's obligations: call before the memfd is sealed against new
writable mappings (the second mapping is writable), and reserve the rest of
the file afterwards (``posix_fallocate`` over the whole length) as for any
arena.  Thread-safety: no shared state; the second mapping lives inside an
address range reserved for it, so no other thread's mapping is touched.
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
GIVE_UP_AFTER = 8         # regions failing in a row: memory is too fragmented, stop trying
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


def collapse(fd: int, length: int, progress=None) -> tuple[int, str]:
    """Put the whole regions of the shmem file ``fd`` (``length`` bytes, already
    ftruncated) in huge pages.  Returns (bytes collapsed, why not all: "" when all were).

    ``progress(done, total, seconds)`` is called every 64 MiB of regions tried."""
    pmd = region_bytes()
    if not pmd:
        return 0, ("this kernel has no transparent huge pages for shmem"
                   + (" (shmem_enabled is deny)" if shmem_policy() == "deny" else ""))
    whole = length // pmd * pmd
    if not whole:
        return 0, f"the arena is smaller than one {pmd >> 20} MiB region"
    for off in range(0, whole, pmd):
        os.posix_fallocate(fd, off, mmap.PAGESIZE)   # one page per region: see the module docstring
    libc = _libc()
    # reserve whole + pmd of address space so an aligned start fits, then map the file there
    span = whole + pmd
    reserve = libc.mmap(None, span, PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if reserve in (None, _MAP_FAILED):
        return 0, "no address space for the collapse mapping"
    start = -(-reserve // pmd) * pmd
    addr = libc.mmap(start, whole, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | MAP_FIXED, fd, 0)
    if addr != start:
        # a failed MAP_FIXED may have unmapped part of [start, start + whole) already, and
        # another thread may have mapped something there since: release only the head and
        # tail of the reservation (the rest leaks a PROT_NONE range, harmlessly)
        if start > reserve:
            libc.munmap(reserve, start - reserve)
        libc.munmap(start + whole, reserve + span - (start + whole))
        return 0, f"cannot map the arena for collapsing ({os.strerror(ctypes.get_errno())})"
    try:
        done, failed_in_row, why, t0 = 0, 0, "", time.monotonic()
        for off in range(0, whole, pmd):
            if libc.madvise(start + off, pmd, MADV_COLLAPSE) == 0:
                done += pmd
                failed_in_row = 0
            else:
                err = ctypes.get_errno()
                if err == errno.EINVAL and off == 0:
                    return 0, "this kernel cannot collapse shmem (MADV_COLLAPSE: Linux 6.1+)"
                why = f"{os.strerror(err)} (memory fragmented or short)"
                failed_in_row += 1
                if failed_in_row >= GIVE_UP_AFTER:
                    break
            if progress and ((off + pmd) % (64 << 20) == 0 or off + pmd == whole):
                progress(off + pmd, whole, time.monotonic() - t0)
        if done < whole and not why:
            why = "some regions could not be collapsed"
        if length > whole:
            why = why or f"the last {length - whole} bytes are less than a region"
        return done, why
    finally:
        libc.munmap(reserve, span)   # the file mapping lies inside the reservation: both go
