"""Fair share of the readers among clients' urgent reads.

A client's urgent read jobs enter the ``ReaderPool`` at most ``fair_jobs``
(2 x readers) at a time; the rest wait in that client's backlog and move up as
its parts finish.  So one client's 32-expert cold fetch cannot put every other
client's miss behind all of it, yet a lone client still keeps every reader
busy (work-conserving).  A backlogged read jumps the line (``release``) when
another client waits on it and at shutdown (so the pool's ``stop`` cancels and
reports it like any other queued job); when its owner dies it goes to the
background queue (nobody waits on it; a later fetch of its key promotes it).
Predicted (background) parts a client starts waiting for are submitted here
too, so predicting keys and then fetching them is no way around the share.

Driven by ``loads.Loads`` (``start``, ``promote``, ``waited_on``,
``to_background``, ``cancel_all``, ``reported``), never by the server directly.

State (server thread only, no lock):
- ``backlog``: client -> deque of its held-back Jobs;
- ``in_pool``: client -> how many of its metered Jobs are in the pool now;
- ``owner``: (load token, part) of every metered Job -> its client.  Metering is per
  part, not per load: a promoted load may have parts that started unmetered.
Background reads are not metered: the pool already serves them after every
urgent read.
"""

from __future__ import annotations

from collections import deque


class FairReads:
    def __init__(self, readers, fair_jobs: int):
        self.readers = readers
        self.fair_jobs = fair_jobs
        self.backlog: dict[int, deque] = {}
        self.in_pool: dict[int, int] = {}
        self.owner: dict[tuple[int, int], int] = {}

    def submit(self, jobs: list, owner: int) -> None:
        """Meter ``owner``'s urgent jobs."""
        for j in jobs:
            self.owner[(j.load_id, j.part)] = owner
        self.backlog.setdefault(owner, deque()).extend(jobs)
        self._feed(owner)

    def part_done(self, load_id: int, part: int) -> None:
        """Part ``part`` of ``load_id`` finished (or was cancelled)."""
        owner = self.owner.pop((load_id, part), None)
        if owner is None:
            return
        self.in_pool[owner] -= 1
        if self.backlog.get(owner):
            self._feed(owner)
        elif not self.in_pool[owner]:
            del self.in_pool[owner]

    def waited_on(self, load_id: int, client: int) -> None:
        """``client`` now waits on load ``load_id``: another client's held-back parts of it go now."""
        for owner in [o for o, q in self.backlog.items() if o != client and any(j.load_id == load_id for j in q)]:
            self.release(owner, load_id)

    def release(self, owner: int, load_id: int | None = None, urgent: bool = True) -> list:
        """Submit ``owner``'s held-back jobs now: those of load ``load_id``, or all (as
        background reads with ``urgent=False``: nobody waits on them).  Returns the jobs moved."""
        q = self.backlog.get(owner)
        if not q:
            return []
        moved = [j for j in q if load_id is None or j.load_id == load_id]
        if not moved:
            return []
        rest = deque(j for j in q if load_id is not None and j.load_id != load_id)
        if rest:
            self.backlog[owner] = rest
        else:
            del self.backlog[owner]
        if urgent:
            self.in_pool[owner] = self.in_pool.get(owner, 0) + len(moved)
        else:                           # background reads are not metered
            for j in moved:
                del self.owner[(j.load_id, j.part)]
            if not self.in_pool.get(owner):
                self.in_pool.pop(owner, None)
        self.readers.submit(moved, urgent)
        return moved

    def release_all(self) -> None:
        for owner in list(self.backlog):
            self.release(owner)

    def held_back(self) -> int:
        return sum(len(q) for q in self.backlog.values())

    def _feed(self, owner: int) -> None:
        """Move ``owner``'s held-back jobs into the pool, up to its fair share."""
        q = self.backlog.get(owner)
        n = self.in_pool.get(owner, 0)
        batch = []
        while q and n < self.fair_jobs:
            batch.append(q.popleft())
            n += 1
        if batch:
            self.readers.submit(batch, True)
        if q is not None and not q:
            del self.backlog[owner]
        self.in_pool[owner] = n
