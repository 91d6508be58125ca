"""The slot store: which key lives in which slot, and the state of every slot.

Slot states and transitions (the server thread is the only caller)::

               fetch miss / predict              complete(ok)
      FREE  ─────────────────────────▶ LOADING ───────────────▶ READY ──┐
        ▲                                 │                      │  ▲   │ fetch: touch + pin
        │        complete(error)          │                      │  └───┘
        ├─────────────────────────────────┘                      │
        │                 evict (LRU, unpinned only)             │
        └────────────────────────────────────────────────────────┘

Invariants:
- ``key_slot`` and ``slot_key`` are inverse maps over non-FREE slots: a key maps
  to at most one slot.
- A LOADING slot is never evicted, never named in a reply, never read by a
  client; it leaves LOADING only when every part of its read has reported.
- A pinned slot (any ``(client, epoch)`` holder) is never evicted.
- Checks that can fail (validation, cache full, quota) run before any change,
  so a refused fetch changes nothing.

The store does no I/O: ``fetch``/``predict`` return the slots whose reads the
caller must start; ``complete`` is called when they finish.  It knows a read
only as a LOADING slot (``Loading``: key, urgent, demote on ready); the read
itself (token, parts, error) belongs to ``reads.loads``.  The caller changes
the store only through its methods (``repin``, ``background`` included), so
its invariants (``check``) hold whatever the caller is.

Thread: the server thread owns the store; no locking.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from k3client.errors import CacheFull, QuotaExceeded

from .policy import LruPolicy
from .stats import Counters

FREE, LOADING, READY = "free", "loading", "ready"


@dataclass
class FetchPlan:
    slots: list[int]                 # in request order
    new_loads: list[int]             # slots whose reads must start (urgent)
    waiting: set[int]                # slots still loading (new or earlier)
    promote: list[int]               # earlier background loads now needed urgently
    misses: int = 0
    evictions: int = 0
    waited: int = 0
    prefetched_hits: int = 0


@dataclass
class Loading:
    """What the store knows of a LOADING slot.  The read itself (token, parts,
    error) is ``reads.loads.Load``, which the store never sees."""
    key: tuple[int, int]
    urgent: bool                     # False: a background read a fetch must promote
    demote_on_ready: bool = False    # an unused prediction: LRU end once READY


@dataclass
class Store:
    slots: int
    pin_quota: int = 0               # max slots one holder may pin; 0 = no limit
    policy: LruPolicy = field(default_factory=LruPolicy)
    stats: Counters = field(default_factory=Counters)

    def __post_init__(self):
        self.state = [FREE] * self.slots
        self.slot_key: list[tuple[int, int] | None] = [None] * self.slots
        self.key_slot: dict[tuple[int, int], int] = {}
        self.free = list(range(self.slots - 1, -1, -1))   # pop() gives slot 0 first
        self.loads: dict[int, Loading] = {}
        self.predicted_by: dict[int, int] = {}            # slot -> predicting client
        self.predictions: dict[int, set[int]] = {}        # client -> slots it predicted

    # -- queries ------------------------------------------------------------
    def gauges(self) -> dict:
        return {"used": self.slots - len(self.free), "pinned": self.policy.pinned_count(),
                "loading": len(self.loads), "free": len(self.free)}

    def pins(self, holder) -> int:
        """How many slots ``holder`` (client, epoch) pins now."""
        return len(self.policy.held(holder))

    # -- fetch --------------------------------------------------------------
    def fetch(self, holder, keys: list[tuple[int, int]]) -> FetchPlan:
        """Plan a fetch of distinct, known keys for ``holder`` (client, epoch)."""
        have = [self.key_slot.get(k) for k in keys]
        if self._all_plain_hits(have):
            for s in have:
                self.policy.pin(s, holder)
                self.policy.touch(s)
            self.stats.fetches += 1
            self.stats.hits += len(keys)
            return FetchPlan(slots=have, new_loads=[], waiting=set(), promote=[])
        resident = {s for s in have if s is not None}
        need = sum(1 for s in have if s is None)
        if need:
            available = len(self.free) + self.policy.evictable(exclude=resident)
            if need > available:
                self.stats.cache_full += 1
                raise CacheFull(
                    f"cache full: {self.policy.pinned_count()} of {self.slots} slots pinned, "
                    f"this fetch needs {need} new slots and only {available} can be freed; "
                    "call begin_token() to release earlier pins, fetch fewer experts, "
                    "or start k3d with a larger --arena")
        if self.pin_quota:
            after = len(self.policy.held(holder) | resident) + need
            if after > self.pin_quota:
                raise QuotaExceeded(
                    f"pin quota exceeded: this fetch would pin {after} slots, the quota is {self.pin_quota} per client "
                    "per token; call begin_token() more often or fetch fewer experts")
        plan = FetchPlan(slots=[], new_loads=[], waiting=set(), promote=[])
        for s in resident:                     # pin hits first so no miss evicts them
            self.policy.pin(s, holder)
        for key, s in zip(keys, have):
            if s is None:
                s, evicted = self._assign(key, urgent=True)
                plan.evictions += evicted
                plan.misses += 1
                plan.new_loads.append(s)
                plan.waiting.add(s)
                self.policy.pin(s, holder)
            elif self.state[s] == LOADING:
                plan.waited += 1
                plan.waiting.add(s)
                load = self.loads[s]
                load.demote_on_ready = False     # wanted after all: keep it MRU once ready
                if not load.urgent:
                    load.urgent = True
                    plan.promote.append(s)
            else:
                self.policy.touch(s)
            if s in self.predicted_by:
                self.predictions[self.predicted_by.pop(s)].discard(s)
                plan.prefetched_hits += 1
            plan.slots.append(s)
        st = self.stats
        st.fetches += 1
        st.misses += plan.misses
        st.hits += len(keys) - plan.misses
        st.waited += plan.waited
        st.evictions += plan.evictions
        st.prefetch_hits += plan.prefetched_hits
        return plan

    def _all_plain_hits(self, have: list) -> bool:
        """Every key READY, none a pending prediction, no quota: nothing can refuse."""
        if self.pin_quota or None in have:
            return False
        state, predicted = self.state, self.predicted_by
        return all(state[s] == READY and s not in predicted for s in have)

    def _assign(self, key, urgent: bool) -> tuple[int, int]:
        """A slot for ``key`` (free, else the LRU victim), now LOADING."""
        evicted = 0
        if self.free:
            s = self.free.pop()
        else:
            s = self.policy.victim()
            assert s is not None, "caller checked capacity"
            self._evict(s)
            evicted = 1
        self.state[s] = LOADING
        self.slot_key[s] = key
        self.key_slot[key] = s
        self.loads[s] = Loading(key, urgent)
        return s, evicted

    def _evict(self, s: int) -> None:
        del self.key_slot[self.slot_key[s]]
        self.slot_key[s] = None
        self.state[s] = FREE
        self.policy.remove(s)
        if s in self.predicted_by:
            self.predictions[self.predicted_by.pop(s)].discard(s)
            self.stats.prefetch_unused += 1

    # -- predict ------------------------------------------------------------
    def predict(self, client: int, keys: list[tuple[int, int]]) -> list[int]:
        """Assign slots to predicted keys not resident; stop at the first that has none."""
        started = []
        for key in keys:
            if key in self.key_slot:
                continue
            if not self.free and self.policy.victim() is None:
                break
            s, evicted = self._assign(key, urgent=False)
            self.stats.evictions += evicted
            self.predicted_by[s] = client
            self.predictions.setdefault(client, set()).add(s)
            started.append(s)
        self.stats.prefetched += len(started)
        return started

    # -- answers and loads after the fact -----------------------------------
    def repin(self, holder, slots: list[int]) -> None:
        """Pin READY ``slots`` for ``holder``, within the pin quota (checked first:
        a refusal changes nothing).  For a fetch answered after its client began
        a new token: the pins it was planned under are gone."""
        if self.pin_quota:
            after = len(self.policy.held(holder) | set(slots))
            if after > self.pin_quota:
                raise QuotaExceeded(
                    f"pin quota exceeded: this fetch, answered after begin_token, would pin {after} slots "
                    f"in the new token, the quota is {self.pin_quota} per client per token; fetch it again")
        for s in slots:
            self.policy.pin(s, holder)

    def background(self, s: int) -> None:
        """The read of LOADING slot ``s`` now runs as a background read (its client
        is gone): a later fetch of its key promotes it (``FetchPlan.promote``)."""
        self.loads[s].urgent = False

    # -- epochs and clients -------------------------------------------------
    def end_epoch(self, client: int, holder) -> tuple[int, int]:
        """Release ``holder``'s pins; demote ``client``'s unused predictions.

        Returns (pins released, predictions found unused)."""
        released = len(self.policy.release(holder))
        unused = self.predictions.pop(client, set())
        for s in unused:
            del self.predicted_by[s]
            if self.state[s] == READY:
                self.policy.demote(s)
            else:
                self.loads[s].demote_on_ready = True
        self.stats.prefetch_unused += len(unused)
        return released, len(unused)

    # -- completion ---------------------------------------------------------
    def complete(self, s: int, error: str | None, counted: bool = True) -> Loading:
        """The read of slot ``s`` finished (all parts). READY, or FREE on error.

        ``counted=False``: a read cancelled by shutdown, not a failure (no ``errors``)."""
        load = self.loads.pop(s)
        if error is None:
            self.state[s] = READY
            self.policy.insert(s)
            if load.demote_on_ready:
                self.policy.demote(s)
        else:
            self.stats.errors += counted
            del self.key_slot[load.key]
            self.slot_key[s] = None
            self.state[s] = FREE
            self.policy.remove(s)
            self.free.append(s)
            if s in self.predicted_by:
                self.predictions[self.predicted_by.pop(s)].discard(s)
        return load

    def check(self) -> None:
        """Assert the invariants (tests call this after every step)."""
        self.policy.check()
        for key, s in self.key_slot.items():
            assert self.slot_key[s] == key and self.state[s] != FREE
        for s in range(self.slots):
            if self.state[s] == FREE:
                assert self.slot_key[s] is None and s in self.free and not self.policy.pinned(s)
            assert (self.state[s] == LOADING) == (s in self.loads)
            assert (self.state[s] == READY) == self.policy.is_ready(s)
        assert len(self.free) == len(set(self.free))
        assert self.stats.hits + self.stats.misses >= self.stats.waited
