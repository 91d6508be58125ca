"""Reader pool: persistent threads that fill slot memory, nothing else.

Queues: two FIFO deques under one condition variable; a reader always takes
from URGENT first, so a background (predicted) read never delays a fetch that
a client is blocked on.  ``take_background(load_id)`` hands back a load's
not-yet-started background parts when a client starts waiting for a predicted
key; ``loads.Loads`` re-submits them urgent, through the client's fair share.

A job is one part of one expert's read: ``Job(load_id, part, extents, dest, source, owner)``;
``load_id`` is the load's token (``loads.Load.id``), not a slot number; ``owner``
the client the read is done for (None: nobody's, e.g. a warm restart's preload).
The reader calls ``source.read(extents, dest)`` (pread straight into the slot)
and reports ``Done(load_id, part, nbytes, seconds, error, owner, cpu)`` on a
SimpleQueue (``cpu``: the reader thread's CPU seconds for it, which the
server charges to ``owner``: ``pacing.py``),
then writes the eventfd so the server loop (which polls it beside the ROUTER
socket) wakes up.  Readers never touch the store, the policy or any socket:
the server thread alone owns those, so that state needs no lock.

Shutdown: ``stop()`` drops queued jobs (reporting each as cancelled) and joins
the threads after their current part; while a reader is stuck in ``read`` past
the timeout, ``stop`` returns False and the eventfd stays open for its late report.

Threads: ``submit``, ``take_background``, ``queued`` and ``stop`` are the server
thread's (through ``loads.Loads``); the ``k3d-reader-N`` threads only run jobs.
The queues are shared between them under ``_cv``; ``done`` and ``wake_fd`` are
the one way back.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass


@dataclass
class Job:
    load_id: int
    part: int
    extents: list
    dest: memoryview
    source: object
    owner: int | None = None


@dataclass
class Done:
    load_id: int
    part: int
    nbytes: int
    seconds: float
    error: str | None
    owner: int | None = None
    cpu: float = 0.0


class ReaderPool:
    def __init__(self, threads: int):
        self.threads = max(1, threads)
        self.done: queue.SimpleQueue[Done] = queue.SimpleQueue()
        self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._cv = threading.Condition()
        self._urgent: deque[Job] = deque()
        self._background: deque[Job] = deque()
        self._stopping = False
        self._workers = [threading.Thread(target=self._run, name=f"k3d-reader-{i}", daemon=True)
                         for i in range(self.threads)]
        for t in self._workers:
            t.start()

    def submit(self, jobs: list[Job], urgent: bool) -> None:
        with self._cv:
            (self._urgent if urgent else self._background).extend(jobs)
            self._cv.notify(len(jobs))

    def take_background(self, load_id: int) -> list[Job]:
        """Remove and return the queued (not started) background parts of ``load_id``:
        the caller re-submits them as urgent reads, metered for the client now waiting."""
        with self._cv:
            taken = [j for j in self._background if j.load_id == load_id]
            if taken:
                self._background = deque(j for j in self._background if j.load_id != load_id)
            return taken

    def queued(self) -> tuple[int, int]:
        with self._cv:
            return len(self._urgent), len(self._background)

    def drain_wake(self) -> None:
        try:
            os.eventfd_read(self.wake_fd)
        except BlockingIOError:
            pass

    def _report(self, d: Done) -> None:
        self.done.put(d)
        if self.wake_fd is not None:
            os.eventfd_write(self.wake_fd, 1)

    def _run(self):
        while True:
            with self._cv:
                while not (self._urgent or self._background or self._stopping):
                    self._cv.wait()
                if self._stopping:
                    return
                job = self._urgent.popleft() if self._urgent else self._background.popleft()
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                n = job.source.read(job.extents, job.dest)
                err = None
            except Exception as e:  # any failure becomes the load's error, never a crash
                n, err = 0, f"{type(e).__name__}: {e}" if not isinstance(e, OSError) else str(e)
            self._report(Done(job.load_id, job.part, n, time.perf_counter() - t0, err, job.owner,
                              time.thread_time() - c0))

    def stop(self, timeout: float = 30.0) -> bool:
        """Cancel queued jobs, wait up to ``timeout`` (in all) for running ones.

        Returns True when every thread has exited.  Otherwise the eventfd stays
        open (a late reader must not write into a reused descriptor number) and
        the caller must not close what the readers use (the source's fds)."""
        with self._cv:
            self._stopping = True
            dropped = list(self._urgent) + list(self._background)
            self._urgent.clear()
            self._background.clear()
            self._cv.notify_all()
        for j in dropped:
            self._report(Done(j.load_id, j.part, 0, 0.0, "cancelled: daemon shutting down"))
        deadline = time.monotonic() + timeout
        for t in self._workers:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        if self.alive():
            return False
        # None first: a signal handler's late wake-up must never write to the closed
        # descriptor's number (another file may have it by then)
        fd, self.wake_fd = self.wake_fd, None
        os.close(fd)
        return True

    def alive(self) -> int:
        return sum(t.is_alive() for t in self._workers)
