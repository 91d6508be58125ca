"""The cache behind the ops: the store, the reads in flight and the parked fetches, moved together.

The server's handlers validate a request and call one method here; each keeps
the three in step:
- ``plan`` (a fetch): the store plans (hits pinned, misses given slots), the
  misses' reads start URGENT in the client's fair share, background reads it
  now waits on are promoted, another client's held-back parts of them go now;
- ``answer``: the fetch's slots at once (every slot READY, checked), or None:
  parked until its reads finish (the server traces and predicts in between);
- ``predict``: slots for predicted keys, read BACKGROUND, within the client's
  prediction room (pin quota, and the waste throttle below);
- ``end_token``: the client's pins go, its unused predictions are counted
  and demoted, and its prediction-waste share moves;
- ``drop``: a client leaves or dies: pins released, held-back reads go on as
  background reads, a fetch it waits on is answered NotAttached;
- ``apply_done``: every read part reported since the last call is counted
  (and its reader CPU handed to ``charge``, for the client it was read for);
  a finished load makes its slot READY (or FREE on error) and answers waiters;
- ``shut_down``: cancel queued reads, wait for running ones, answer every
  parked fetch.

Prediction throttle (with a pin quota): a client has at most that many
predictions outstanding, and a client whose predictions go almost all unused
(moving share > ``WASTE_LIMIT``) may start one read per token: a flood of
predictions can neither sweep the cache nor monopolise the readers.

Owns no state of its own beyond these three and the counters it adds to:
the store is changed only through its methods, a read only through ``reads``.

Thread: the server thread; reader threads reach this only through the pool's
queue (``apply_done``).
"""

from __future__ import annotations

import logging
import time

from k3d.cache.parked import Parked, checked_slots
from k3d.cache.sessions import Session
from k3d.cache.store import FetchPlan, Store
from k3d.observe.latency import FetchLatency, classify
from k3d.observe.stats import Throughput
from k3d.reads.loads import Load, Loads

log = logging.getLogger("k3d")

WASTE_LIMIT = 0.9        # share of unused predictions above which a client is throttled


class Cache:
    def __init__(self, store: Store, source, arena, readers: int, replies, latency: FetchLatency, charge):
        """``charge(client_id, cpu_seconds)``: told the readers' CPU spent for each client."""
        self.store, self.stats = store, store.stats
        self.charge = charge
        self.latency = latency
        self.recent = Throughput()
        self.reads = Loads(readers, source, arena)
        self.parked = Parked(store, replies, source.path, latency)

    # -- fetch and predict -------------------------------------------------------
    def plan(self, s: Session, keys: list[tuple[int, int]]) -> FetchPlan:
        """Plan ``s``'s fetch of ``keys`` and start the reads it needs (raises CacheFull /
        QuotaExceeded with nothing changed)."""
        plan = self.store.fetch(s.holder, keys)
        self._start(plan.new_loads, urgent=True, owner=s.client_id)
        for slot in plan.promote:     # its predicted reads not started yet: urgent, in its fair share
            self.reads.promote(slot, s.client_id)
        for slot in plan.waiting:     # someone else's held-back read: this client waits too
            self.reads.waited_on(slot, s.client_id)
        s.fetches += 1
        return plan

    def answer(self, s: Session, rid: int, keys, plan: FetchPlan, t0: float) -> list[int] | None:
        """The slots to reply with now, or None: the fetch is parked and answered later."""
        result = classify(plan.misses, plan.waited)
        if not plan.waiting:
            slots = checked_slots(self.store, keys, plan.slots)
            self.latency.record(result, time.monotonic() - t0)
            return slots
        self.parked.park(s, rid, keys, plan.slots, plan.waiting, t0, result)
        return None

    def predict(self, s: Session, keys, pin_quota: int, trace=None) -> int:
        """Start background reads of ``keys`` not resident; returns how many started.
        ``trace``: the route trace gets the keys as the store gets them (``k3d replay``
        reproduces the prefetch counters from them)."""
        keys = list(dict.fromkeys(keys))
        if pin_quota:
            room = pin_quota - len(self.store.predictions.get(s.client_id, ()))
            if s.pf_waste > WASTE_LIMIT:
                room = min(room, 1 - s.pf_started)
            keys = [k for k in keys if k not in self.store.key_slot][:max(0, room)]
        if trace is not None:
            trace.predict(time.monotonic(), s.client_id, s.epoch, keys)
        started = self.store.predict(s.client_id, keys)
        s.pf_started += len(started)
        self._start(started, urgent=False, owner=s.client_id)
        return len(started)

    def end_token(self, s: Session) -> int:
        """``s`` begins its next token: its pins go.  Returns the pins released."""
        released, unused = self.store.end_epoch(s.client_id, s.holder)
        s.pfu += unused
        if s.pf_started:
            s.pf_waste = 0.8 * s.pf_waste + 0.2 * min(1.0, unused / s.pf_started)
        s.pf_started = 0
        s.epoch += 1
        return released

    def drop(self, s: Session, reason: str) -> int:
        """``s`` is gone (the caller removes the session).  Returns the pins released."""
        released, _ = self.store.end_epoch(s.client_id, s.holder)
        self.store.forget_client(s.client_id)
        # Its held-back reads go on as background reads (another client may fetch
        # those keys: that promotes them), never ahead of the urgent reads of others.
        for slot in self.reads.to_background(s.client_id):
            self.store.background(slot)
        self.parked.drop(s, reason)
        return released

    def preload(self, slots: list[int]) -> None:
        """Warm restart: read ``slots`` (``Store.preload``) BACKGROUND, behind every urgent read."""
        self._start(slots, urgent=False)

    def _start(self, slots: list[int], urgent: bool, owner: int | None = None) -> None:
        key_of = self.store.slot_key
        self.reads.start([(slot, key_of[slot]) for slot in slots], urgent, owner)

    # -- completion ------------------------------------------------------------
    def apply_done(self, draining: bool = False) -> None:
        """Count every part reported; finish every load whose last part came.
        ``draining``: a failed read was cancelled by shutdown (ShuttingDown, not counted)."""
        now = time.monotonic()
        for d, load in self.reads.reported():
            self.stats.bytes_read += d.nbytes
            self.stats.read_seconds += d.seconds
            self.recent.add(now, d.nbytes)
            if d.owner is not None:
                self.charge(d.owner, d.cpu)
            if load is not None:
                self._finished(load, draining)

    def _finished(self, load: Load, draining: bool) -> None:
        cancelled = bool(load.fail) and draining
        self.store.complete(load.slot, load.fail, counted=not cancelled)
        if load.fail and not cancelled:
            log.warning("read of expert (layer %d, expert %d) failed: %s", *load.key, load.fail)
        self.parked.finished(load, cancelled)

    def shut_down(self) -> None:
        """Cancel queued reads, wait for running ones (30 s at most), answer every parked fetch."""
        if not self.reads.cancel_all():
            log.error("%d reader(s) still busy after 30 s; exiting without waiting for them",
                      self.reads.readers_alive())
        self.apply_done(draining=True)
        self.parked.shut_down()
