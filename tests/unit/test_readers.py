"""Unit: the reader pool's queues, completion reports and shutdown."""

import contextlib
import queue
import threading

from helpers import poll_for
from k3d.reads.pool import Job, ReaderPool


class Gate:
    """A source whose reads record their order and wait on a gate; ``entered`` is set once a
    reader is inside ``read``."""

    def __init__(self):
        self.gate, self.entered = threading.Event(), threading.Event()
        self.order = []

    def read(self, extents, dest):
        self.entered.set()
        self.gate.wait(10)
        self.order.append(extents)
        return 1


def drain(pool, n, timeout=5):
    """The next ``n`` completion reports."""
    out = []

    def got_n():
        with contextlib.suppress(queue.Empty):
            out.append(pool.done.get(timeout=0.1))
        return len(out) >= n

    poll_for(got_n, timeout, lambda: f"{n} completion reports, got {out}", interval=0)
    return out


def test_urgent_before_background_and_promote():
    src = Gate()
    pool = ReaderPool(1)
    pool.submit([Job(0, 0, "first", None, src)], urgent=True)     # occupies the only reader
    assert src.entered.wait(5)
    pool.submit([Job(1, 0, "bg-1", None, src), Job(2, 0, "bg-2", None, src)], urgent=False)
    pool.submit([Job(3, 0, "urgent", None, src)], urgent=True)
    taken = pool.take_background(2)                              # a client now waits on load 2
    assert [j.extents for j in taken] == ["bg-2"] and pool.queued() == (1, 1)
    assert pool.take_background(2) == []
    pool.submit(taken, urgent=True)
    src.gate.set()
    done = drain(pool, 4)
    assert [d.error for d in done] == [None] * 4
    assert src.order == ["first", "urgent", "bg-2", "bg-1"]
    assert pool.stop() is True and pool.wake_fd is None


def test_failure_is_reported_not_raised():
    class Broken:
        def read(self, extents, dest):
            raise OSError(5, "Input/output error")

    pool = ReaderPool(2)
    pool.submit([Job(7, 0, [], None, Broken())], urgent=True)
    [d] = drain(pool, 1)
    assert d.load_id == 7 and "Input/output error" in d.error
    assert pool.stop()


def test_stop_cancels_queued_and_keeps_eventfd_while_a_reader_is_stuck():
    src = Gate()
    pool = ReaderPool(1)
    pool.submit([Job(0, 0, "stuck", None, src), Job(1, 0, "queued", None, src)], urgent=True)
    assert src.entered.wait(5)
    assert pool.stop(timeout=0.2) is False          # the reader is still inside read()
    assert pool.wake_fd is not None and pool.alive() == 1
    cancelled = drain(pool, 1)
    assert cancelled[0].load_id == 1 and cancelled[0].error.startswith("cancelled")
    src.gate.set()                                   # the late reader reports without harm
    assert drain(pool, 1)[0].load_id == 0
    for t in pool._workers:
        t.join(5)
    import os
    os.close(pool.wake_fd)
