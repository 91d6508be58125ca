"""The store: what requests do to the slot table, and the counters they keep.

``Store`` is the slot table (``SlotTable``, ``k3d.cache.slots``: the slot states,
their transitions and invariants, the shared index, deferred reuse) with the
requests on it: a fetch's plan, predictions, pins and their end, hit reports,
a warm restart's preload.  The store keeps the ``Counters``.

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
taken and ``loading_skips`` counts it (``SlotTable._victim``; a run with
``loading_skips == 0`` replays exactly).  Only ``waited`` depends on timing.

Invariant (besides the table's): checks that can fail (validation, cache full,
quota: ``k3d.cache.refusals``) run before any change, so a refused fetch changes
nothing.

The store does no I/O: ``fetch``/``predict`` return the slots whose reads the
caller must start; ``complete`` is called when they finish.  The caller changes
the store only through its methods (``repin``, ``background`` included), so its
invariants (``check``) hold whatever the caller is.

Hit reports: clients that answer their hits from the shared index report them
later (``report_all``, a step in ``k3d.cache.reported``), with the same effect on
the policy and the counters as a fetch of those keys.

Predictions: ``predict`` assigns and pins the slots; who predicted which slot, and
what came of it per client, is the store's ``book`` (``PredictionBook``,
``k3d.cache.predictions``), told by the store when a predicted slot is used,
evicted, fails or its client's token ends.

Thread: the server thread owns the store; no locking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from k3client.errors import SlotsBusy
from k3d.cache import refusals, reported
from k3d.cache.predictions import PREDICT
from k3d.cache.slots import LOADING, READY, SlotTable


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


class Store(SlotTable):
    """The slot table with the requests on it (module docstring)."""

    # -- queries ------------------------------------------------------------
    def pins(self, holder) -> int:
        """How many slots ``holder`` (client, epoch) pins now."""
        return len(self.policy.held(holder))

    def step_pins(self, client: int, holder) -> int:
        """How many slots ``holder`` (client, epoch) and ``client``'s predictions pin now."""
        held, predicted = self.policy.held(holder), self.policy.held((PREDICT, client))
        if not predicted:
            return len(held)
        # the overlap counted, not built: no new set at each fetch (the smaller one walked)
        small, big = (predicted, held) if len(predicted) <= len(held) else (held, predicted)
        both = 0
        for s in small:
            if s in big:
                both += 1
        return len(held) + len(predicted) - both

    # -- fetch --------------------------------------------------------------
    def fetch(self, holder, keys: list[tuple[int, int]], now: float = 0.0) -> FetchPlan:
        """Plan a fetch of distinct, known keys for ``holder`` (client, epoch)."""
        have: list[Any] = [self.key_slot.get(k) for k in keys]   # slot, None: a miss
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
        free = len(self.free)
        if need > free:                # (free slots enough: nothing can refuse, no count needed)
            self.pressed = now
            # nor when the unpinned residents less every slot the fetch excludes are enough
            # and every victim is reusable now (the bound never exceeds the exact count)
            if not (free + policy.evictable() - len(resident) - len(self.loads) >= need
                    and self.reuse.could_reuse_now()):
                evictable = policy.evictable(exclude=resident.union(self.loads))
                refused = refusals.room(need, free, evictable, self.reuse, policy, self.slots)
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
        state, predicted, slots = self.state, self.book.predicted_by, plan.slots
        # hits are touched in runs (one call per run), each run before the next miss's
        # victim is chosen: the order the policy hears of keys is the request order
        run_s: list[int] = []
        run_k: list = []
        for key, s in zip(keys, have):
            if s is None:
                if run_s:
                    policy.touch_all(run_s, run_k)
                    run_s, run_k = [], []
                s, evicted = self._assign(key, urgent=True, now=now, holder=holder)
                plan.evictions += evicted
                plan.misses += 1
                plan.new_loads.append(s)
                plan.waiting.add(s)
            elif state[s] == LOADING:
                plan.waited += 1
                plan.waiting.add(s)
                run_s.append(s)
                run_k.append(key)
                load = self.loads[s]
                if not load.urgent:
                    load.urgent = True
                    plan.promote.append(s)
            else:
                run_s.append(s)
                run_k.append(key)
            if s in predicted:
                plan.prefetched_hits += self.book.used(s)
            slots.append(s)
        if run_s:
            policy.touch_all(run_s, run_k)
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
        reuse_now = None                        # (asked once: nothing here changes it)
        for key in keys:
            if key in self.key_slot:
                continue
            victim = None
            if not self.free:
                if reuse_now is None:
                    reuse_now = self.reuse.could_reuse_now()
                if not reuse_now:
                    break                       # make_room frees slots ahead for the next ones
                victim = self._victim()
                if victim is None:
                    break
                if not self.policy.admits(key, victim, q.confidence()):
                    self.stats.prefetch_refused += 1
                    q.refused += 1
                    break
            s, evicted = self._assign(key, urgent=False, victim=victim, now=now, holder=(PREDICT, client))
            self.stats.evictions += evicted
            self.book.add(client, s)
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

    # -- answers after the fact ---------------------------------------------
    def repin(self, holder, slots: list[int]) -> None:
        """Pin READY ``slots`` for ``holder``, within the pin quota (checked first:
        a refusal changes nothing).  For a fetch answered after its client began
        a new token: the pins it was planned under are gone."""
        quota = self.live.pin_quota
        if quota:
            refusals.repin_quota(len(self.policy.held(holder) | set(slots)), quota)
        for s in slots:
            self.policy.pin(s, holder)
