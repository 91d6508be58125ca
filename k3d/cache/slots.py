"""The slot table: which key lives in which slot, and the state of every slot.

Slot states and transitions (the server thread is the only caller)::

               fetch miss / predict              complete(ok)
      FREE  ─────────────────────────▶ LOADING ───────────────▶ READY ──┐
        ▲                                 │                      │  ▲   │ fetch: touch + pin
        │        complete(error)          │                      │  └───┘
        ├─────────────────────────────────┘                      │
        │          evict (policy victim: unpinned, READY)        │
        └────────────────────────────────────────────────────────┘

``SlotTable`` holds the table and makes every transition (``_assign``,
``_evict``, ``complete``; ``complete_all`` for a batch read without error),
telling the policy, the shared index, ``reuse`` and the ``PredictionBook`` as it
goes.  ``Store`` (``k3d.cache.store``) is built on
it: what requests do (fetch plans, predictions, pins and their end, hit
reports, a warm restart's preload) decides when a transition happens.

Invariants (``check``):
- ``key_slot`` and ``slot_key`` are inverse maps over non-FREE slots: a key maps
  to at most one slot.  ``resident`` (``k3d.cache.resident``) is ``key_slot`` as
  one byte per key, changed at the same three places (``_assign``, ``_evict``, a
  failed ``complete``).
- A LOADING slot is never evicted, never named in a reply, never read by a
  client; it leaves LOADING only when every part of its read has reported.
- A pinned slot (any ``(client, epoch)`` holder) is never evicted; so it keeps the
  key it was pinned for, and ``release_layers`` finds a layer's pins by their keys.

The table does no I/O: it knows a read only as a LOADING slot (``Loading``: key,
urgent); the read itself (token, parts, error) belongs to ``reads.loads``, and
``complete`` is called when it finishes.  The caller changes the table only
through its methods (``background`` included), so its invariants hold whatever
the caller is.

Shared index and deferred reuse: every change of a key's slot or state is
published in the shared index (``index``; ``k3d.memory.index``), where clients
answer their hits without a message.  An evicted slot leaves the cache at once,
but its memory is reused only when ``reuse`` (``k3d.cache.reuse``) says no client
can still read it; until then it waits outside the free list.  A fetch needs
slots that are free or reusable now: when only waiting ones would do, it raises
``SlotsBusy`` (the client retries) and ``make_room`` evicts ahead.  With one
client, blocked in the request that evicts, every victim is reusable at once,
so slots, counters and the trace are those of a store without the index.

Thread: the server thread owns the table; no locking.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from k3d.cache.policy import LruPolicy, PinTable
from k3d.cache.predictions import PREDICT, PredictionBook
from k3d.cache.resident import ResidentRows
from k3d.cache.reuse import Reuse
from k3d.config import Live
from k3d.memory.index import NoIndex
from k3d.observe.stats import Counters

FREE, LOADING, READY = "free", "loading", "ready"
PRESSURE_S = 1.0         # seconds after a miss found no free slot during which make_room keeps the reserve


@dataclass
class Loading:
    """What the table knows of a LOADING slot.  The read itself (token, parts,
    error) is ``reads.loads.Load``, which the store never sees."""
    key: tuple[int, int]
    urgent: bool                     # False: a background read a fetch must promote


@dataclass
class SlotTable:
    """The slot table and its transitions; ``Store`` adds what requests do to it."""

    slots: int
    live: Live = field(default_factory=Live)             # its pin_quota is read at each use
    policy: PinTable = field(default_factory=LruPolicy)  # any k3d.cache.policy class
    stats: Counters = field(default_factory=Counters)
    key_bytes: Any = None            # key -> bytes one read of it costs (unused_bytes); None: 0
    index: Any = field(default_factory=NoIndex)          # the shared index clients read (k3d.memory.index)
    reuse: Reuse = field(default_factory=Reuse)
    reserve: int = 0                 # slots kept free or waiting while several clients read the index

    def __post_init__(self) -> None:
        self.want = 0                                     # slots a refused fetch needed (make_room)
        self.pressed = float("-inf")                      # when a miss last found no free slot
        self.state = [FREE] * self.slots
        self.slot_key: list[Any] = [None] * self.slots       # key, None where FREE
        self.key_slot: dict[tuple[int, int], int] = {}
        self.resident = ResidentRows(self.key_slot)       # key_slot as one byte per key (the predictor's)
        self.free = list(range(self.slots - 1, -1, -1))   # pop() gives slot 0 first
        self.loads: dict[int, Loading] = {}
        self.book = PredictionBook()                      # who predicted which slot; per-client figures

    # -- queries ------------------------------------------------------------
    def gauges(self) -> dict:
        waiting = len(self.reuse.limbo)
        return {"used": self.slots - len(self.free) - waiting, "pinned": self.policy.pinned_count(),
                "loading": len(self.loads), "free": len(self.free), "reuse_waiting": waiting}

    # -- transitions ------------------------------------------------------
    def _victim(self) -> int | None:
        """The policy's victim among slots not LOADING (see Determinism)."""
        s = self.policy.victim()
        if s is not None and s in self.loads:
            self.stats.loading_skips += 1
            s = self.policy.victim(exclude=self.loads)
        return s

    def _assign(self, key, urgent: bool, victim: int | None = None, now: float = 0.0,
                holder=None) -> tuple[int, int]:
        """A slot for ``key`` (free, else ``victim`` or the policy's, reusable now: the
        caller checked), now LOADING and inserted in the policy's order (request time),
        pinned for ``holder`` if one is given (before any other victim is chosen)."""
        policy, predicted = self.policy, not urgent
        if victim is None and self.free:
            s = self.free.pop()
            evicted = 0
            if holder is None:
                policy.insert(s, key, predicted)
            else:
                policy.insert_pinned(s, key, predicted, holder)
        else:
            v = self._victim() if victim is None else victim
            assert v is not None, "caller checked capacity"
            s = v
            assert holder is not None, "only a fetch or a prediction evicts (a preload takes free slots)"
            reusable = self._evict(s, now)
            assert reusable, "caller checked that a victim is reusable now"
            evicted = 1
            policy.replace(s, key, predicted, holder)
        self.state[s] = LOADING
        self.slot_key[s] = key
        self.key_slot[key] = s
        self.resident.add(key)
        self.loads[s] = Loading(key, urgent)
        self.index.loading(key, s)
        return s, evicted

    def _evict(self, s: int, now: float) -> bool:
        """``s`` leaves the cache (and the index).  True: its memory may be reused now;
        False: it waits in ``reuse`` until no client can read it.  The policy has
        removed ``s`` already, or does as it gives the slot away: ``policy.victims`` and
        ``policy.replace`` remove each victim as they take it."""
        key = self.slot_key[s]
        by = self.book.drop(s)                 # (a prediction: not reached while predictions are pinned)
        if by is not None:
            self._unused(by, [key])
        del self.key_slot[key]
        self.resident.discard(key)
        self.slot_key[s] = None
        self.state[s] = FREE
        self.index.clear(key)
        return self.reuse.retire(s, now)

    def _unused(self, client: int, keys: list) -> None:
        """Predictions of ``keys`` by ``client`` were never used (still resident)."""
        n = sum(self.key_bytes(k) for k in keys) if self.key_bytes is not None else 0
        self.stats.prefetch_unused += len(keys)
        self.stats.prefetch_unused_bytes += n
        self.book.unused(client, len(keys), n)

    # -- room: deferred reuse ------------------------------------------------
    def make_room(self, now: float) -> int:
        """Evict ahead while several clients read the index and misses have lately found no
        free slot (within ``PRESSURE_S``), so that slots are free when the next miss comes
        (evicted slots wait for reuse first); and as many as a refused fetch wanted.  A
        cache whose working set fits evicts nothing ahead.  Returns how many it evicted."""
        pressed = now - self.pressed < PRESSURE_S and len(self.reuse.viewers) > 1
        target = max(self.want, self.reserve if pressed else 0)
        evicted = 0
        # each eviction adds one slot to free or to the unclaimed wait (a slot just retired
        # is nobody's claim): counted here, not by ``coming()`` again, O(waiting) each
        room = len(self.free) + self.reuse.coming()
        if room < target:
            # the policy removes each victim as it chooses it (nothing of the store's
            # evictions below reads the policy, so the victims are those one by one)
            victims, skips = self.policy.victims(target - room, self.loads)
            self.stats.loading_skips += skips
            for s in victims:
                if self._evict(s, now):
                    self.free.append(s)
            evicted = len(victims)
        self.stats.evictions += evicted
        self.stats.evicted_ahead += evicted
        if len(self.free) >= self.want:
            self.want = 0
        return evicted

    def reclaim(self, now: float) -> int:
        """Slots no client can read any more go back to the free list; returns how many."""
        slots = self.reuse.reclaim()
        self.free.extend(slots)
        return len(slots)

    # -- loads --------------------------------------------------------------
    def background(self, s: int) -> None:
        """The read of LOADING slot ``s`` now runs as a background read (its client
        is gone): a later fetch of its key promotes it (``FetchPlan.promote``)."""
        self.loads[s].urgent = False

    def complete(self, s: int, error: str | None, counted: bool = True) -> Loading:
        """The read of slot ``s`` finished (all parts). READY, or FREE on error.

        ``counted=False``: a read cancelled by shutdown, not a failure (no ``errors``)."""
        load = self.loads.pop(s)
        if error is None:
            self.state[s] = READY
            self.index.ready(load.key, s)
        else:
            self.index.clear(load.key)     # never READY: no client read it, so the slot is free now
            self.reuse.unpublished()       # (one count with the index's: clients report it as ``seen``)
            self.stats.errors += counted
            del self.key_slot[load.key]
            self.resident.discard(load.key)
            self.slot_key[s] = None
            self.state[s] = FREE
            self.policy.remove(s)
            self.free.append(s)
            self.book.drop(s)              # a failed prediction is not an unused one
        return load

    def complete_all(self, slots: list[int]) -> None:
        """The reads of LOADING ``slots`` all finished without error (a batch read inline):
        each READY, as ``complete(s, None)`` makes it."""
        loads, state, ready = self.loads, self.state, self.index.ready
        for s in slots:
            ready(loads.pop(s).key, s)
            state[s] = READY

    def check(self) -> None:
        """Assert the invariants listed above."""
        self.policy.check()
        self.resident.check()
        for key, s in self.key_slot.items():
            assert self.slot_key[s] == key and self.state[s] != FREE
        for s in range(self.slots):
            if self.state[s] == FREE:
                assert self.slot_key[s] is None and not self.policy.pinned(s)
                assert (s in self.free) != (s in self.reuse.limbo)
            assert (self.state[s] == LOADING) == (s in self.loads)
            assert (self.state[s] != FREE) == self.policy.has(s)
        assert len(self.free) == len(set(self.free))
        assert not set(self.free) & self.reuse.limbo.keys()
        assert self.index.retired() in (None, self.reuse.retired), "the index's count is not reuse's"
        assert self.stats.hits + self.stats.misses >= self.stats.waited
        self.book.check()
        for s, c in self.book.predicted_by.items():
            assert self.state[s] != FREE and s in self.policy.held((PREDICT, c)), "a prediction not resident and pinned"
