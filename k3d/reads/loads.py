"""Loads in flight: the server's only door to reads.

A ``Load`` is one expert's read into one slot, named by an explicit token
(``Load.id``, never reused while the daemon runs; not a slot number: a slot
holds many loads over its life).  It is cut into parts (``plan.split_extents``);
every part is a ``pool.Job`` carrying the token, and every part reports one
``pool.Done`` carrying it back.  ``Loads`` keeps the bookkeeping no other
module touches: the loads in flight (by token, and by slot for the one load a
LOADING slot has), the parts still out and the first error of each.

What the server asks (its whole vocabulary):
- ``start(slots_keys, urgent, owner)``: read these keys into these slots for
  ``owner`` (its reports name it, so the server can charge it the readers' CPU);
  urgent reads with an owner go through that client's fair share (``fair``);
- ``promote(slot, client)``: a client now waits on a background read: its
  parts not yet started go urgent, metered for that client;
- ``waited_on(slot, client)``: another client's held-back parts of it go now;
- ``to_background(client)``: the client is gone; its held-back reads go on as
  background reads (returns their slots);
- ``reported()``: each pool part report since the last call, with the ``Load``
  once its last part reported (then it has left the books);
- ``take_inline()``: the slots ``start`` read itself since the last call
  (``InlineDone``), all finished without error; ``inline_pending()`` names them
  without taking them (the caller must take them before it answers anything);
- ``cancel_all()``: shutdown: held-back parts join the pool, which cancels
  queued ones and joins its threads.

Inline reads (``inline.py``): ``start`` first copies each small expert whose
bytes are all in the page cache on the calling (server) thread; such a read is
finished when ``start`` returns, gets no ``Load``, token or report, and is never
in the books or the pool: its slot waits in ``_inline`` for ``take_inline()``
(the server completes the batch in one pass).  The rest are cut
into parts for the readers as before, with one hand-over (one ``submit``, one
notify) for the whole call.

Memory: each load gets one memoryview of its slot (``arena.view(slot)``) that
all its parts share; the remote and packed sources recognise a load's parts
by that object, so it is made once per load, here.

Thread: the server thread owns this object.  Reader threads see only the Jobs
handed to the pool and answer through the pool's queue and eventfd.
"""

from __future__ import annotations

import itertools
import queue
from collections.abc import Iterator

from .fair import FairReads
from .inline import MAX_BYTES, InlineDone, InlineReads
from .plan import parts_per_key, split_extents
from .pool import Done, Job, ReaderPool


class Load:
    """One read of one key into one slot; ``id`` is its token."""

    __slots__ = ("dest", "fail", "id", "key", "parts_left", "slot", "stale")

    def __init__(self, load_id: int, slot: int, key: tuple[int, int], dest: memoryview) -> None:
        self.id, self.slot, self.key, self.dest = load_id, slot, key, dest
        self.parts_left = 0
        self.fail: str | None = None          # the first part's error; the load failed
        self.stale = False                    # failed because its source file changed (fail says which)


class Loads:
    def __init__(self, threads: int, source, arena, inline: bool = False) -> None:
        """``inline``: read small cached experts in ``start`` (``inline.py``; the server's
        choice, off for callers that drive the pool itself)."""
        self.source, self.arena = source, arena
        self.pool = ReaderPool(threads)
        # Two parts per reader keep the pool busy for a lone client (no idle
        # reader between a part's end and the next submit).
        self.fair = FairReads(self.pool, fair_jobs=2 * self.pool.threads)
        self._ids = itertools.count(1)
        self._by_id: dict[int, Load] = {}
        self._by_slot: dict[int, Load] = {}
        self.inline = InlineReads(source, max_bytes=MAX_BYTES if inline else 0)
        # (not `_inline`: the compiled build names the field `__inline`, a C keyword)
        self._read_inline = InlineDone()  # read by start(), not yet taken

    # -- what status shows ---------------------------------------------------
    @property
    def threads(self) -> int:
        return self.pool.threads

    @property
    def wake_fd(self) -> int:
        return self.pool.wake_fd

    def queued(self) -> tuple[int, int]:
        return self.pool.queued()

    def held_back(self) -> int:
        return self.fair.held_back()

    def in_flight(self) -> int:
        return len(self._by_id)

    # -- start ----------------------------------------------------------------
    def start(self, slots_keys: list[tuple[int, tuple[int, int]]], urgent: bool,
              owner: int | None = None) -> list[Load]:
        """Start reading each key into its slot (all LOADING in the store).  Keys
        started together share the readers: each is cut into that many parts.
        Returns the loads handed to the pool; the keys read inline are not among
        them (``take_inline``)."""
        if not slots_keys:
            return []
        if self.inline.max_bytes:
            slots_keys = self.inline.read_all(slots_keys, self.arena.view, self._read_inline)
            if not slots_keys:
                return []
        todo = []
        view = self.arena.view
        for slot, key in slots_keys:
            assert slot not in self._by_slot, f"slot {slot} already has a load in flight"
            todo.append((Load(next(self._ids), slot, key, view(slot)), self.source.keys[key]))
        loads = [load for load, _ in todo]
        parts = parts_per_key(self.pool.threads, len(todo), self.source.max_parts)
        jobs: list = []
        for load, extents in todo:
            groups = split_extents(extents, parts)
            load.parts_left = len(groups)
            self._by_id[load.id] = self._by_slot[load.slot] = load
            jobs.extend(Job(load.id, i, g, load.dest, self.source, owner) for i, g in enumerate(groups))
        if owner is None or not urgent:
            self.pool.submit(jobs, urgent)
        else:
            self.fair.submit(jobs, owner)
        return loads

    def promote(self, slot: int, client: int) -> None:
        """``client`` waits on slot's background read: its queued parts go urgent, in its share."""
        taken = self.pool.take_background(self._by_slot[slot].id)
        for j in taken:
            j.owner = client
        if taken:
            self.fair.submit(taken, client)

    def waited_on(self, slot: int, client: int) -> None:
        """``client`` waits on slot's read: another client's held-back parts of it go now."""
        self.fair.waited_on(self._by_slot[slot].id, client)

    # -- cancel ---------------------------------------------------------------
    def to_background(self, client: int) -> list[int]:
        """``client`` is gone: its held-back parts go on as background reads.
        Returns the slots of those loads (the store marks them background too)."""
        moved = self.fair.release(client, urgent=False)
        return list(dict.fromkeys(self._by_id[j.load_id].slot for j in moved))

    def cancel_all(self, timeout: float = 30.0) -> bool:
        """Shutdown: cancel every queued part (each reports as cancelled), wait up to
        ``timeout`` for running ones.  False if a reader is still busy (see pool.stop)."""
        self.fair.release_all()       # so that stop() cancels and reports them
        return self.pool.stop(timeout)

    def readers_alive(self) -> int:
        return self.pool.alive()

    # -- finish ---------------------------------------------------------------
    def reported(self) -> Iterator[tuple[Done, Load | None]]:
        """Every pool part report queued so far: (report, the load if it is now finished).
        A finished load has left the books; ``load.fail`` says how it ended."""
        done = self.pool.done
        while True:
            try:
                d = done.get_nowait()
            except queue.Empty:
                return
            load = self._by_id[d.load_id]
            load.parts_left -= 1
            self.fair.part_done(d.load_id, d.part)
            if d.error and load.fail is None:
                load.fail = d.error
            if load.parts_left:
                yield d, None
                continue
            del self._by_id[load.id]
            del self._by_slot[load.slot]
            yield d, load

    def inline_pending(self) -> list[int]:
        """The slots read inline and not taken yet (LOADING in the store until taken)."""
        return self._read_inline.slots

    def take_inline(self) -> InlineDone | None:
        """The slots ``start`` read itself since the last call (None: none)."""
        if not self._read_inline.slots:
            return None
        done, self._read_inline = self._read_inline, InlineDone()
        return done

    def has_reports(self) -> bool:
        """Whether a pool part report waits (a hint: one queued after this is seen next
        pass, since its reader writes the eventfd after queueing it)."""
        return not self.pool.done.empty()

    def drain_wake(self) -> None:
        self.pool.drain_wake()
