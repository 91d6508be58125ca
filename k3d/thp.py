"""Transparent huge pages for the arena's memfd, with no reservation by the administrator.

Why: an O_DIRECT read into the arena is as fast as the slot's pages are
physically contiguous (on this VM a virtio request carries at most 254
segments: 13 MB into scattered 4 KiB pages reads at ~1.9 GB/s, into 2 MiB runs
at ~2.7 GB/s), and 4 KiB shmem pages are contiguous or not by the luck of the
free lists.  ``--hugepages`` fixes that with hugetlb pages, which someone must
reserve first; this module gets the same 2 MiB runs from ordinary memory.

How: ``MADV_COLLAPSE`` (Linux 6.1+) replaces the pages behind a range of a
mapping with PMD-sized folios; for a shmem file those folios belong to the
*file*, so every mapping of it, at any address (the daemon's own writable one,
the clients' read-only ones), reads and DMAs into the same 2 MiB runs, even
where it maps them with 4 KiB page-table entries.  MADV_COLLAPSE ignores the
sysfs THP policy except ``deny`` (``shmem_enabled`` is ``never`` on this VM and
it still works).  Its range must be mapped at a PMD-aligned address, which
Python's ``mmap`` cannot ask for, so ``collapse`` maps the fd a second time
through libc at an aligned address inside a PROT_NONE reservation, collapses
PMD region by PMD region (to count what succeeded), and unmaps it again: no
Python object ever sees that mapping.

Memory layout: file offsets ``[k * pmd, (k + 1) * pmd)`` for whole regions
inside ``length`` become one huge folio each where the kernel finds a free
2 MiB block (it compacts to make one); the tail after the last whole region,
and any region it could not collapse, stay 4 KiB pages.  Before collapsing,
each region gets one 4 KiB page (``posix_fallocate``): a region with no page
cannot be collapsed, and one with all 512 would be copied page by page
(measured: 2 GiB in 0.6-2.5 s seeded vs 5.8 s fully allocated).

Best effort: on a kernel without MADV_COLLAPSE, with ``shmem_enabled=deny``,
or short of free 2 MiB blocks, fewer regions (or none) are collapsed and the
arena works exactly as before.  The caller's obligations: call before the
memfd is sealed against new writable mappings (the second mapping is
writable), and reserve the rest of the file afterwards (``posix_fallocate``
over the whole length) as for any arena.  Thread-safety: no shared state.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time

MADV_COLLAPSE = 25
MAP_FIXED = 0x10
PROT_NONE = 0
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


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def collapse(fd: int, length: int, progress=None) -> int:
    """Put the whole PMD regions of the shmem file ``fd`` (``length`` bytes, already
    ftruncated) in huge pages; returns the bytes now in huge pages (0 when unsupported).

    ``progress(done, total, seconds)`` is called every 256 MiB of regions tried."""
    pmd = pmd_bytes()
    if not pmd or shmem_policy() == "deny":
        return 0
    whole = length // pmd * pmd
    if not whole:
        return 0
    for off in range(0, whole, pmd):
        os.posix_fallocate(fd, off, mmap.PAGESIZE)   # see the module docstring: a seed per region
    libc = _libc()
    # reserve whole + pmd of address space so an aligned start fits, then map the file there
    reserve = libc.mmap(None, whole + pmd, PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if reserve in (None, _MAP_FAILED):
        return 0
    try:
        start = -(-reserve // pmd) * pmd
        addr = libc.mmap(start, whole, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | MAP_FIXED, fd, 0)
        if addr != start:
            return 0
        done, t0 = 0, time.monotonic()
        for off in range(0, whole, pmd):
            if libc.madvise(start + off, pmd, MADV_COLLAPSE) == 0:
                done += pmd
            elif ctypes.get_errno() == 22 and off == 0:
                return 0          # EINVAL on the first region: this kernel cannot collapse shmem
            # other errors (EAGAIN, ENOMEM: no free 2 MiB block): that region stays 4 KiB pages
            if progress and ((off + pmd) % (256 << 20) == 0 or off + pmd == whole):
                progress(off + pmd, whole, time.monotonic() - t0)
        return done
    finally:
        libc.munmap(reserve, whole + pmd)   # the file mapping lies inside the reservation: both go
