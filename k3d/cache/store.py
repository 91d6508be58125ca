"""The slot store: which key lives in which slot, and the state of every slot.

Slot states and transitions (the server thread is the only caller)::

               fetch miss / predict              complete(ok)
      FREE  ─────────────────────────▶ LOADING ───────────────▶ READY ──┐
        ▲                                 │                      │  ▲   │ fetch: touch + pin
        │        complete(error)          │                      │  └───┘
        ├─────────────────────────────────┘                      │
        │          evict (policy victim: unpinned, READY)        │
        └────────────────────────────────────────────────────────┘

Determinism: the policy hears of a key when it is *requested* (``insert`` for a
miss or a prediction, ``touch`` for a hit or a key still loading), once per key, in
request order, never when a read completes; a prediction is pinned under
``("predict", client)`` until that client's next ``end_epoch``; a client's fetch
pins last until its next ``end_epoch`` or its release of their layer
(``release_layers``, a ``done`` line in the trace).  So victims and
counters (hits, misses, evictions, prefetched, prefetch_hits, prefetch_unused) are
a function of the request sequence alone, which ``k3d replay`` reproduces.  The one
exception is physical: a LOADING slot is never a victim; when the policy's choice is
still loading (a background read slower than a whole token) the next choice is
taken and ``loading_skips`` counts it (a run with ``loading_skips == 0`` replays
exactly).  Only ``waited`` depends on timing.

Invariants:
- ``key_slot`` and ``slot_key`` are inverse maps over non-FREE slots: a key maps
  to at most one slot.  ``resident`` (``k3d.cache.resident``) is ``key_slot`` as
  one byte per key, changed at the same three places (``_assign``, ``_evict``, a
  failed ``complete``).
- A LOADING slot is never evicted, never named in a reply, never read by a
  client; it leaves LOADING only when every part of its read has reported.
- A pinned slot (any ``(client, epoch)`` holder) is never evicted; so it keeps the
  key it was pinned for, and ``release_layers`` finds a layer's pins by their keys.
- Checks that can fail (validation, cache full, quota: ``k3d.cache.refusals``)
  run before any change, so a refused fetch changes nothing.

The store does no I/O: ``fetch``/``predict`` return the slots whose reads the
caller must start; ``complete`` is called when they finish.  It knows a read
only as a LOADING slot (``Loading``: key, urgent); the read itself (token, parts,
error) belongs to ``reads.loads``.  The caller changes the store only through its
methods (``repin``, ``background`` included), so its invariants (``check``) hold
whatever the caller is.

Shared index and deferred reuse: every change of a key's slot or state is
published in the shared index (``index``; ``k3d.memory.index``), where clients
answer their hits without a message.  An evicted slot leaves the cache at once,
but its memory is reused only when ``reuse`` (``k3d.cache.reuse``) says no client
can still read it; until then it waits outside the free list.  A fetch needs
slots that are free or reusable now: when only waiting ones would do, it raises
``SlotsBusy`` (the client retries) and ``make_room`` evicts ahead.  With one
client, blocked in the request that evicts, every victim is reusable at once,
so slots, counters and the trace are those of a store without the index.
Clients report their hits later (``report_all``, a step in ``k3d.cache.reported``),
with the same effect on the policy and the counters as a fetch of those keys.

Predictions: ``predict`` assigns and pins the slots; who predicted which slot, and
what came of it per client, is the store's ``book`` (``PredictionBook``,
``k3d.cache.predictions``), told by the store when a predicted slot is used,
evicted, fails or its client's token ends.  The store keeps the ``Counters``.

Thread: the server thread owns the store; no locking.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from k3client.errors import SlotsBusy
from k3d.cache import refusals, reported
from k3d.cache.policy import LruPolicy
from k3d.cache.predictions import PREDICT, PredictionBook
from k3d.cache.resident import ResidentRows
from k3d.cache.reuse import Reuse
from k3d.config import Live
from k3d.memory.index import NoIndex
from k3d.observe.stats import Counters

FREE, LOADING, READY = "free", "loading", "ready"
PRESSURE_S = 1.0         # seconds after a miss found no free slot during which make_room keeps the reserve


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


@dataclass
class Store:
    slots: int
    live: Live = field(default_factory=Live)             # its pin_quota is read at each use
    policy: object = field(default_factory=LruPolicy)    # any k3d.cache.policy class
    stats: Counters = field(default_factory=Counters)
    key_bytes: object = None         # key -> bytes one read of it costs (unused_bytes); None: 0
    index: object = field(default_factory=NoIndex)       # the shared index clients read (k3d.memory.index)
    reuse: Reuse = field(default_factory=Reuse)
    reserve: int = 0                 # slots kept free or waiting while several clients read the index

    def __post_init__(self):
        self.want = 0                                     # slots a refused fetch needed (make_room)
        self.pressed = float("-inf")                      # when a miss last found no free slot
        self.state = [FREE] * self.slots
        self.slot_key: list[tuple[int, int] | None] = [None] * self.slots
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

    def pins(self, holder) -> int:
        """How many slots ``holder`` (client, epoch) pins now."""
        return len(self.policy.held(holder))

    def step_pins(self, client: int, holder) -> int:
        """How many slots ``holder`` (client, epoch) and ``client``'s predictions pin now."""
        held, predicted = self.policy.held(holder), self.policy.held((PREDICT, client))
        return len(held | predicted) if predicted else len(held)

    # -- fetch --------------------------------------------------------------
    def fetch(self, holder, keys: list[tuple[int, int]], now: float = 0.0) -> FetchPlan:
        """Plan a fetch of distinct, known keys for ``holder`` (client, epoch)."""
        have = [self.key_slot.get(k) for k in keys]
        policy = self.policy
        if self._all_plain_hits(have):
            self.book.client_quality(holder[0]).ready += len(keys)
            for layer in dict.fromkeys(k[0] for k in keys):
                policy.visit(layer)
            policy.pin_all(have, holder)
            policy.touch_all(have, keys)
            self.stats.fetches += 1
            self.stats.hits += len(keys)
            return FetchPlan(slots=have, new_loads=[], waiting=set(), promote=[])
        resident = {s for s in have if s is not None}
        need = have.count(None)
        if need:
            if need > len(self.free):
                self.pressed = now
            evictable = policy.evictable(exclude=resident.union(self.loads))
            refused = refusals.room(need, len(self.free), evictable, self.reuse, policy, self.slots)
            if refused is not None:
                if isinstance(refused, SlotsBusy):
                    self.want = max(self.want, need)
                    self.stats.slots_busy += 1
                else:
                    self.stats.cache_full += 1
                raise refused
        quota = self.live.pin_quota
        if quota:
            refusals.fetch_quota(len(policy.held(holder) | resident | self.reuse.claims(holder[0])) + need, quota)
        plan = FetchPlan(slots=[], new_loads=[], waiting=set(), promote=[])
        for layer in dict.fromkeys(k[0] for k in keys):
            policy.visit(layer)
        policy.pin_all(resident, holder)       # pin hits first so no miss evicts them
        state, predicted, touch, slots = self.state, self.book.predicted_by, policy.touch, plan.slots
        for key, s in zip(keys, have):
            if s is None:
                s, evicted = self._assign(key, urgent=True, now=now)
                plan.evictions += evicted
                plan.misses += 1
                plan.new_loads.append(s)
                plan.waiting.add(s)
                policy.pin(s, holder)
            elif state[s] == LOADING:
                plan.waited += 1
                plan.waiting.add(s)
                touch(s, key)
                load = self.loads[s]
                if not load.urgent:
                    load.urgent = True
                    plan.promote.append(s)
            else:
                touch(s, key)
            if s in predicted:
                plan.prefetched_hits += self.book.used(s)
            slots.append(s)
        st = self.stats
        st.fetches += 1
        st.misses += plan.misses
        st.hits += len(keys) - plan.misses
        st.waited += plan.waited
        st.evictions += plan.evictions
        st.prefetch_hits += plan.prefetched_hits
        q = self.book.client_quality(holder[0])
        q.missed += plan.misses
        q.waited += plan.waited
        q.ready += len(keys) - plan.misses - plan.waited
        return plan

    def _all_plain_hits(self, have: list) -> bool:
        """Every key READY, none a pending prediction, no quota: nothing can refuse."""
        if self.live.pin_quota or None in have:
            return False
        state, predicted = self.state, self.book.predicted_by
        return all(state[s] == READY and s not in predicted for s in have)

    def _victim(self) -> int | None:
        """The policy's victim among slots not LOADING (see Determinism)."""
        s = self.policy.victim()
        if s is not None and s in self.loads:
            self.stats.loading_skips += 1
            s = self.policy.victim(exclude=self.loads)
        return s

    def _assign(self, key, urgent: bool, victim: int | None = None, now: float = 0.0) -> tuple[int, int]:
        """A slot for ``key`` (free, else ``victim`` or the policy's, reusable now: the
        caller checked), now LOADING and inserted in the policy's order (request time)."""
        evicted = 0
        if victim is None and self.free:
            s = self.free.pop()
        else:
            s = self._victim() if victim is None else victim
            assert s is not None, "caller checked capacity"
            reusable = self._evict(s, now)
            assert reusable, "caller checked that a victim is reusable now"
            evicted = 1
        self.state[s] = LOADING
        self.slot_key[s] = key
        self.key_slot[key] = s
        self.resident.add(key)
        self.loads[s] = Loading(key, urgent)
        self.policy.insert(s, key, predicted=not urgent)
        self.index.loading(key, s)
        return s, evicted

    def _evict(self, s: int, now: float) -> bool:
        """``s`` leaves the cache (and the index).  True: its memory may be reused now;
        False: it waits in ``reuse`` until no client can read it."""
        key = self.slot_key[s]
        by = self.book.drop(s)                 # (a prediction: not reached while predictions are pinned)
        if by is not None:
            self._unused(by, [key])
        del self.key_slot[key]
        self.resident.discard(key)
        self.slot_key[s] = None
        self.state[s] = FREE
        self.policy.remove(s)
        self.index.clear(key)
        return self.reuse.retire(s, now)

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
        while room < target:
            s = self._victim()
            if s is None:
                break
            if self._evict(s, now):
                self.free.append(s)
            evicted += 1
            room += 1
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

    # -- predictions ----------------------------------------------------------
    def predict(self, client: int, keys: list[tuple[int, int]], now: float = 0.0) -> list[int]:
        """Assign slots to predicted keys not resident; stop at the first that has none.

        A background read never evicts a pinned slot (every client's current token),
        nor one the policy expects to be reused sooner than the prediction
        (``policy.admits`` with the client's measured precision as the confidence):
        ``prefetch_refused`` counts those.  Each prediction is pinned under
        ``(PREDICT, client)`` until the client's next ``end_epoch``."""
        started = []
        q = self.book.client_quality(client)
        for key in keys:
            if key in self.key_slot:
                continue
            victim = None
            if not self.free:
                if not self.reuse.could_reuse_now():
                    break                       # make_room frees slots ahead for the next ones
                victim = self._victim()
                if victim is None:
                    break
                if not self.policy.admits(key, victim, q.confidence()):
                    self.stats.prefetch_refused += 1
                    q.refused += 1
                    break
            s, evicted = self._assign(key, urgent=False, victim=victim, now=now)
            self.stats.evictions += evicted
            self.book.add(client, s)
            self.policy.pin(s, (PREDICT, client))
            started.append(s)
        self.stats.prefetched += len(started)
        q.prefetched += len(started)
        return started

    def end_epoch(self, client: int, holder) -> tuple[int, int]:
        """Release ``holder``'s pins; demote ``client``'s unused predictions.

        Returns (pins released, predictions found unused)."""
        released = len(self.policy.release(holder))
        unused = self.book.end_epoch(client)
        if not unused and not self.policy.held((PREDICT, client)):
            return released, 0
        self.policy.release((PREDICT, client))
        unused = unused or []
        for s in unused:
            self.policy.demote(s)
        self._unused(client, [self.slot_key[s] for s in unused])
        return released, len(unused)

    def release_layers(self, holder, layers) -> int:
        """``holder``'s client is done with ``layers`` (a set) for this epoch: its pins of
        slots holding their keys go, and its claims of slots reported under them
        (``Reuse.release_layers``).  Its predictions not used yet stay pinned under
        ``(PREDICT, client)`` until ``end_epoch`` judges them; a used one (a fetch took
        it: out of the ``book``, already counted) is no prediction any more, and its
        pin goes with its layer, as does one of the daemon's own predictions for the
        client (``auto_id``: ``-1 - client``).  A pinned slot keeps its key (it is
        never evicted), so a slot's key names the layer it was pinned for.  Returns the
        pins dropped (counted in ``pins_done``)."""
        key_of, policy, outstanding = self.slot_key, self.policy, self.book.predicted_by
        client = holder[0]
        mine = sorted(s for s in policy.held(holder) if key_of[s][0] in layers)
        n = policy.release_some(holder, mine) if mine else 0
        for who in (client, -1 - client):
            used = sorted(s for s in policy.held((PREDICT, who)) if s not in outstanding and key_of[s][0] in layers)
            if used:
                n += policy.release_some((PREDICT, who), used)
        self.reuse.release_layers(client, layers)
        self.stats.layers_done += len(layers)
        self.stats.pins_done += n
        return n

    def _unused(self, client: int, keys: list) -> None:
        """Predictions of ``keys`` by ``client`` were never used (still resident)."""
        n = sum(self.key_bytes(k) for k in keys) if self.key_bytes is not None else 0
        self.stats.prefetch_unused += len(keys)
        self.stats.prefetch_unused_bytes += n
        self.book.unused(client, len(keys), n)

    def quota_room(self, client: int, started: int, wasteful: bool) -> int | None:
        """How many more predictions ``client`` may start this token under the pin quota
        (None: no quota); see ``PredictionBook.quota_room``."""
        return self.book.quota_room(client, started, wasteful, self.live.pin_quota)

    def forget_client(self, client: int) -> None:
        """The client left (after its ``end_epoch``): its figures join the gone ones."""
        self.book.forget_client(client)

    # -- hit reports ------------------------------------------------------------
    def report(self, holder, keys: list[tuple[int, int]], seen: list[int]) -> int:
        """One report (``report_all`` of one); returns the predicted slots it used."""
        return self.report_all(holder, [(keys, seen)])[0][0]

    def report_all(self, holder, reports, pin: bool = True, quota: int = 0) -> tuple[list[int], int]:
        """Apply a request's hit reports: ``k3d.cache.reported.apply``, which see."""
        return reported.apply(holder, reports, pin, quota, key_slot=self.key_slot, state=self.state,
                              loads=self.loads, policy=self.policy, reuse=self.reuse, book=self.book,
                              stats=self.stats)

    # -- warm restart -------------------------------------------------------
    def preload(self, keys: list[tuple[int, int]]) -> list[int]:
        """Warm restart: assign free slots to ``keys`` (hottest first) not resident, never
        evicting and never pinning; returns the slots to read (BACKGROUND), hottest first.
        The policy hears of them coldest first, so the hottest end up most recent."""
        todo = [k for k in dict.fromkeys(keys) if k not in self.key_slot][:len(self.free)]
        slots = []
        for key in reversed(todo):
            s, _ = self._assign(key, urgent=False)
            slots.append(s)
        self.stats.warm_loaded += len(slots)
        return slots[::-1]

    def ranking(self) -> list[tuple[int, int]]:
        """Keys hottest first, as the policy sees them (what a warm restart pre-loads)."""
        return self.policy.ranking(self.slot_key)

    # -- answers and loads after the fact -----------------------------------
    def repin(self, holder, slots: list[int]) -> None:
        """Pin READY ``slots`` for ``holder``, within the pin quota (checked first:
        a refusal changes nothing).  For a fetch answered after its client began
        a new token: the pins it was planned under are gone."""
        quota = self.live.pin_quota
        if quota:
            refusals.repin_quota(len(self.policy.held(holder) | set(slots)), quota)
        for s in slots:
            self.policy.pin(s, holder)

    def background(self, s: int) -> None:
        """The read of LOADING slot ``s`` now runs as a background read (its client
        is gone): a later fetch of its key promotes it (``FetchPlan.promote``)."""
        self.loads[s].urgent = False

    # -- completion ---------------------------------------------------------
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
