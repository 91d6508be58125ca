"""The arena's preparation after ready: huge-page collapse of the rest, then pre-fault.

Why after ready: at start the arena is only made safe (``k3d.memory.arena``:
every page reserved, so a memory shortage is a clear error then, never a
SIGBUS or an OOM kill later) and its cheap huge pages collapsed; collapsing
the regions that need the kernel to reclaim or compact first, and mapping
every page into the daemon's address space, cost 10-40 s for a 16 GiB arena
on a 23 GiB VM (bench/README.md, "start-up at 16 GiB") and change no byte, so
they run here while the loop serves.

Order: 64 MiB chunks from offset 0 up; in each, first the regions not yet in
huge pages are collapsed (``Collapser.region``: a copy, safe while a slot in
it is read into or read: ``k3d/memory/thp.py``), then the chunk is pre-faulted
in the daemon's writable mapping (``MADV_POPULATE_WRITE``, or a read of one
byte a page on kernels before 5.14: never a write, clients' bytes may be
there).  A slot filled before its chunk is reached simply takes its page
faults on that first write, as any mapping does; no byte depends on this
thread.  Collapsing stops for good after ``GIVE_UP_AFTER`` regions in a row
fail for want of memory (each failure may have compacted and reclaimed in
vain); a region busy with an O_DIRECT read (EAGAIN) is skipped without
counting.

State for ``status`` (read from any thread; each field a plain int or str set
by this thread): ``state`` ``running`` -> ``done`` (or ``stopped`` when the
arena closed first, ``failed`` on an unexpected error: the arena still serves,
taking its faults on first writes), ``done``/``total`` bytes pre-faulted, ``thp_bytes`` in
huge pages so far (the start's included), ``thp_why`` why not all.

Thread: one daemon thread, nice 10 (the loop and the readers come first); its
syscalls release the GIL.  ``stop`` returns once it has finished its current
step (one region, or one chunk's pre-fault); the arena calls it before it
unmaps anything.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import time

import numpy as np

from k3d.memory.thp import why_failed

MADV_POPULATE_WRITE = 23
CHUNK = 64 << 20            # a stop waits for one chunk's pre-fault at most
GIVE_UP_AFTER = 8           # regions failing in a row: memory is too fragmented, stop trying


class Preparer:
    def __init__(self, mm, mapped: int, collapser=None, first: int = 0, thp_why: str = "", on_done=None):
        """``mm``: the daemon's writable mapping of ``mapped`` bytes; ``collapser``: the
        arena's ``Collapser`` (None: no collapse), whose regions below ``first`` are huge
        pages already (this thread closes it); ``on_done(preparer)`` is called on this
        thread when it ends (not when stopped)."""
        self.mm, self.total, self.collapser, self.first = mm, mapped, collapser, first
        self.whole = collapser.whole if collapser is not None else 0
        self.thp_bytes, self.thp_why, self.on_done = first, thp_why, on_done
        self.state, self.done, self.seconds = "waiting", 0, 0.0
        self._stop = threading.Event()
        self._thread = None

    def start(self) -> None:
        self.state = "running"
        self._thread = threading.Thread(target=self._run, name="k3d-arena-prepare", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        elif self.collapser is not None:      # never started: its mapping is still ours to close
            self.collapser.close()
            self.collapser = None

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end; whether it has."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._thread is not None and not self._thread.is_alive()

    def status(self) -> dict:
        return {"state": self.state, "done": self.done, "total": self.total, "seconds": round(self.seconds, 3)}

    def outcome(self) -> str:
        """What it did, in words (for the log once it has ended)."""
        if self.state != "done":
            return f"{self.thp_why} after {self.seconds:.1f}s; it serves on, taking page faults on first writes"
        thp = "" if self.thp_why == "off" else \
            f", {self.thp_bytes >> 20} of {self.total >> 20} MiB in transparent huge pages" \
            + (f" ({self.thp_why})" if self.thp_why else "")
        return f"pre-faulted{thp}, {self.seconds:.1f}s after ready"

    def _run(self):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except OSError:
            pass                              # not allowed here: run at the loop's priority
        t0 = time.monotonic()
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        anchor = ctypes.c_char.from_buffer(self.mm)
        base = ctypes.addressof(anchor)
        del anchor                            # no export held: the mapping stays until stop() returned
        c, failed_in_row = self.collapser, 0
        try:
            for off in range(0, self.total, CHUNK):
                n = min(CHUNK, self.total - off)
                if c is not None:
                    failed_in_row = self._collapse(c, off, off + n, failed_in_row)
                    if failed_in_row >= GIVE_UP_AFTER:
                        c.close()
                        c = self.collapser = None
                if self._stop.is_set():
                    self.state = "stopped"
                    return
                if libc.madvise(base + off, n, MADV_POPULATE_WRITE):
                    # before Linux 5.14: read one byte a page (a write could undo a client's slot)
                    int(np.frombuffer(self.mm, np.uint8, n, off)[::4096].max())
                self.done = off + n
                self.seconds = time.monotonic() - t0
            if self.whole and not self.thp_why:
                if self.thp_bytes < self.whole:
                    self.thp_why = "some regions were busy with O_DIRECT reads"
                elif self.total > self.whole:
                    self.thp_why = f"the last {self.total - self.whole} bytes are less than a region"
            self.state = "done"
        except Exception as e:   # noqa: BLE001 -- the arena stays reserved and correct: say so, serve on
            self.state, self.thp_why = "failed", f"the preparation stopped: {e!r}"
        finally:
            if c is not None:
                c.close()
                self.collapser = None
            self.seconds = time.monotonic() - t0
        if self.on_done is not None:
            self.on_done(self)

    def _collapse(self, c, lo: int, hi: int, failed_in_row: int) -> int:
        """Collapse the regions of [lo, hi) at or after ``first``; returns failures in a row."""
        pmd = c.pmd
        for off in range(max(lo, self.first) // pmd * pmd, min(hi, c.whole), pmd):
            if off < self.first or self._stop.is_set():
                continue
            err = c.region(off)
            if not err:
                self.thp_bytes += pmd
                failed_in_row = 0
            elif err != errno.EAGAIN:
                self.thp_why = why_failed(err, self.thp_bytes == 0)
                failed_in_row += 1
                if failed_in_row >= GIVE_UP_AFTER or err == errno.EINVAL:
                    self.thp_why += f"; gave up at {off >> 20} MiB"
                    return GIVE_UP_AFTER
        return failed_in_row
