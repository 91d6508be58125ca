"""The fetch service: one call per op, keeping the store, the reads in flight and the parked fetches in step.

The loop validates a request and makes one call here, with the client's session:
- ``fetch``: the client's earlier hit reports first (``report``), then the store
  plans (hits pinned, misses given slots), the misses' reads start URGENT in the
  client's fair share, background reads it now waits on are promoted, the route
  trace gets the line, the client's predictions follow (``predict``), and the
  fetch is answered: at once (every slot READY, checked) or parked until its reads
  finish (latency is recorded where the reply is sent).  Small misses in the page
  cache are read on this thread (``k3d.reads.inline``); all a fetch reads so (its
  misses, the client's and the daemon's predictions) is finished in one pass
  before the reply (``_finish_inline``: one sum, one check of their files).
- ``report``: fetches the client answered itself from the shared index (each a
  layer, its experts and the slots it saw), applied as hits in order
  (``Store.report``), each traced as a fetch line;
- ``done``: after a message's reports, the layers its client is done with this
  token: their pins and claims go (``Store.release_layers``), a ``done`` trace line;
- ``predict``: slots for predicted keys, read BACKGROUND, within the client's
  prediction room (pin quota, and the waste throttle below); none with
  ``--predict off`` (``client_predictions`` False);
- the daemon's own predictions (``--predict auto``; ``auto``, an
  ``AutoPrefetch`` from ``k3d.cache.predict``, None otherwise): after each fetch
  and the client's predictions, the predictor learns the fetch and fills what is
  left of the fetch's budget (``_auto``: its reads BACKGROUND, an ``auto`` trace
  line); a reported fetch only teaches it (the client has moved on);
- ``begin_token``: reports, then the client's pins go, its unused predictions are
  counted and demoted, and its prediction-waste share moves; with ``auto``, the
  daemon predicts the new token's first layer (an ``auto`` line after ``begin``);
  the loop thread's CPU in ``auto``'s hooks and in starting its reads is added to
  ``auto.cpu_ns`` at each (status ``prediction.daemon.cpu_s``: what predicting
  costs, measured where it is paid); a fetch or report in a token it skips
  (``AutoPrefetch.idle``) is only counted, unmeasured: the two clock reads would
  cost more than the counter;
- ``drop``: a client leaves or dies: pins released, held-back reads go on as
  background reads, a fetch it waits on is answered NotAttached;
- ``settle``: after each request, slots no client can read any more are freed
  and, while several clients read the index, room is made ahead of misses;
- ``apply_done``: every read part reported since the last call is counted
  (and its reader CPU handed to ``charge``, for the client it was read for);
  a finished load makes its slot READY (or FREE on error) and answers waiters;
- ``shut_down``: cancel queued reads, wait for running ones, answer every
  parked fetch.

Source files changed while served (``watch``, a ``k3d.sources.identity.FileWatch``;
None for remote sources, which pin their origin's ETag instead): every finished
load's files are checked after its last part reported and before its slot goes
READY (once per file per ``apply_done`` pass, after the pass has collected its
loads; the descriptors: a replaced path is the watch's once-a-second check), so a
read that a write reached fails instead of being served; a fetch
that needs a read from a changed file fails at once, and predicted or warm-restart
reads of it are not started.  Experts already resident stay: each was checked
after its whole read, so it holds the old file's bytes, all of them.  ``settle``
checks every file once a second, so the change is logged without a read.

Prediction throttle (with a pin quota): a client has at most that many
predictions outstanding, and a client whose predictions go almost all unused
(moving share > ``WASTE_LIMIT``) may start one read per token: a flood of
predictions can neither sweep the cache nor monopolise the readers.

Owns no state of its own beyond these three and the counters it adds to:
the store is changed only through its methods, a read only through ``reads``.
``trace`` is the route trace (None: off); a SIGHUP reload replaces it.

Thread: the server thread; reader threads reach this only through the pool's
queue (``apply_done``).
"""

from __future__ import annotations

import logging
import time
from time import thread_time_ns
from typing import Any

from k3client.errors import ReadFailed
from k3d.cache.parked import Parked, checked_slots
from k3d.cache.sessions import Session
from k3d.cache.slots import LOADING, PRESSURE_S
from k3d.cache.store import Store
from k3d.observe.latency import FetchLatency, classify
from k3d.observe.stats import Throughput
from k3d.reads.loads import Load, Loads
from k3d.sources.identity import FileWatch

log = logging.getLogger("k3d")

WASTE_LIMIT = 0.9        # share of unused predictions above which a client is throttled


class FetchService:
    def __init__(self, store: Store, source, arena, readers: int, replies, latency: FetchLatency, charge) -> None:
        """``charge(client_id, cpu_seconds)``: told the readers' CPU spent for each client
        (None: nobody is charged, pacing is off)."""
        self.store, self.stats = store, store.stats
        self.charge = charge
        self.live = store.live             # the route trace: live.trace (SIGHUP reopens it)
        self.recent = Throughput()
        self.reads = Loads(readers, source, arena, inline=True)
        self.parked = Parked(store, replies, source.path, latency)
        self.source = source
        self.watch = FileWatch.of(source, time.monotonic())
        self._key_files: dict[tuple[int, int], tuple[int, ...]] = {}
        self.client_predictions = True   # False: --predict off
        self.auto: Any = None            # AutoPrefetch: the daemon's own predictions (--predict auto)

    # -- the ops -----------------------------------------------------------------
    def fetch(self, s: Session, rid: int, keys, predicted, hits, t0: float) -> None:
        """Answer ``s``'s fetch of ``keys`` (now, or once its reads finish).  Raises
        CacheFull / SlotsBusy / QuotaExceeded with nothing of the fetch changed (its
        ``hits`` reports are applied first, whatever follows)."""
        now = time.monotonic()
        if hits:
            self.report(s, hits, now)
        store = self.store
        if self.watch is not None and self.watch.changed:
            for key in keys:
                if key not in store.key_slot and key in self.source.keys:
                    msg = self._changed(key)
                    if msg:
                        raise ReadFailed(f"expert (layer {key[0]}, expert {key[1]}): {msg}")
        plan = store.fetch(s.holder, keys, now)
        try:
            # Inline reads of the misses, predictions and the daemon's own are finished
            # together below (one pass for the whole request); until then their slots
            # are LOADING and pinned, so nothing here evicts or waits on them.
            if plan.new_loads:
                self._start(plan.new_loads, urgent=True, owner=s.client_id, finish=False)
            for slot in plan.promote:     # its predicted reads not started yet: urgent, in its fair share
                self.reads.promote(slot, s.client_id)
            waiting = plan.waiting
            if plan.new_loads:
                # misses read inline are READY below (or failed: a file changed under them)
                state, inline = store.state, self.reads.inline_pending()
                waiting = {slot for slot in waiting if state[slot] == LOADING and slot not in inline}
            for slot in waiting:          # someone else's held-back read: this client waits too
                self.reads.waited_on(slot, s.client_id)
            s.fetches += 1
            self._trace_fetch(s, keys, now, plan.misses, plan.evictions, plan.waited, plan.prefetched_hits)
            started = self.predict(s, predicted, now, in_fetch=True) if predicted else 0
            self._note_pins(s)    # once: its predictions only add pins
            if self.auto is not None:             # the daemon's own, after the client's
                self._auto(s, keys, plan, started, now)
        finally:
            done = self.reads.take_inline()
            if done is not None:
                self._finish_inline(done)
        result = classify(plan.misses, plan.waited)
        if plan.new_loads and self.watch is not None and self.watch.changed:
            for key in keys:              # an inline read that a file change reached: as a reader's
                msg = None if key in store.key_slot else self._changed(key)
                if msg:
                    raise ReadFailed(f"expert (layer {key[0]}, expert {key[1]}): {msg}")
        if waiting:
            self.parked.park(s, rid, keys, plan.slots, waiting, t0, result)
            return
        self.parked.answer(s, rid, checked_slots(store, keys, plan.slots), t0, result)

    def report(self, s: Session, hits, now: float, ends_epoch: bool = False) -> int:
        """Apply ``s``'s hit reports: ``[(keys, slots seen), ...]`` in the order it fetched.
        ``ends_epoch``: ``s``'s epoch ends next (``begin_token``), so no pins are taken
        (``Store.report_all``); returns the pins that ending it would have released."""
        if not hits:
            return 0
        used, skipped = self.store.report_all(s.holder, hits, pin=not ends_epoch, quota=s.pin_quota)
        if not ends_epoch:
            self._note_pins(s)
        s.fetches += len(hits)
        if self.live.trace is not None:
            for (keys, _), prefetched in zip(hits, used):
                self._trace_fetch(s, keys, now, prefetched=prefetched)
        if self.auto is not None and not self.auto.idle(s.client_id, len(hits)):
            # learn only: the client is past these layers
            t = thread_time_ns()
            self.auto.after_reports(s.client_id, hits)
            self.auto.cpu_ns += thread_time_ns() - t
        return skipped

    def done(self, s: Session, layers: set[int], now: float) -> int:
        """``s`` is done with ``layers`` this token (after the message's reports, which may
        name them): its pins and claims of them go, its predictions not used yet stay
        (``Store.release_layers``); the trace gets a ``done`` line.  Returns the pins dropped."""
        if self.live.trace is not None:
            self.live.trace.done(now, s.client_id, s.epoch, layers)
        return self.store.release_layers(s.holder, layers)

    def predict(self, s: Session, keys, now: float, in_fetch: bool = False) -> int:
        """Start background reads of ``keys`` not resident; returns how many started.
        The route trace gets the keys as the store gets them (``k3d replay``
        reproduces the prefetch counters from them).  ``in_fetch``: the predictions
        that come with a fetch, which finishes their inline reads and takes ``s``'s
        pin peak once, after its own pins and these."""
        if not self.client_predictions:
            return 0
        store = self.store
        keys = list(dict.fromkeys(keys))
        room = store.quota_room(s.client_id, s.pf_started, s.pf_waste > WASTE_LIMIT)
        if room is not None:
            keys = [k for k in keys if k not in store.key_slot][:max(0, room)]
        if self.live.trace is not None:
            self.live.trace.predict(now, s.client_id, s.epoch, keys)
        started = store.predict(s.client_id, keys, now)
        s.pf_started += len(started)
        if started and not in_fetch:
            self._note_pins(s)
        if started:
            self._start(started, urgent=False, owner=s.client_id, finish=not in_fetch)
        return len(started)

    def begin_token(self, s: Session, hits) -> int:
        """``s`` begins its next token: its reports first, then its pins go.  Returns the
        pins released."""
        now = time.monotonic()
        skipped = self.report(s, hits, now, ends_epoch=True)
        if self.live.trace is not None:
            self.live.trace.begin(now, s.client_id, s.epoch)
        released, unused = self.store.end_epoch(s.client_id, s.holder)
        released += skipped
        s.end_step()
        if self.auto is not None:             # after the client's own, as k3d replay does
            t = thread_time_ns()
            self.auto.end_token(s.client_id)
            # the token's first layer, which no client can name yet
            proposed, started = self.auto.begin_token(s.client_id, now)
            if started:
                self._start(started, urgent=False, owner=s.client_id)
            self.auto.cpu_ns += thread_time_ns() - t
            if self.live.trace is not None:
                self.live.trace.auto(now, s.client_id, s.epoch + 1, proposed)
        self.store.reuse.new_token(s.client_id)
        s.unused_predictions += unused
        if s.pf_started:
            s.pf_waste = 0.8 * s.pf_waste + 0.2 * min(1.0, unused / s.pf_started)
        s.pf_started = 0
        s.epoch += 1
        return released

    def _note_pins(self, s: Session) -> None:
        """``s.step_peak``: the most slots pinned for ``s`` this epoch (its fetches' and
        reports' pins and its predictions'; they only grow at a fetch, a report, a prediction)."""
        n = self.store.step_pins(s.client_id, s.holder)
        if n > s.step_peak:
            s.step_peak = n

    def settle(self, now: float) -> None:
        """After a request: free what no client can read any more, and make room ahead."""
        store = self.store
        if self.watch is not None:
            self.watch.due(now)
        if store.reuse.limbo:
            store.reclaim(now)
        if store.want or now - store.pressed < PRESSURE_S:
            store.make_room(now)

    def _trace_fetch(self, s: Session, keys, now: float, misses: int = 0, evictions: int = 0,
                     waited: int = 0, prefetched: int = 0) -> None:
        if self.live.trace is not None:
            try:
                self.live.trace.fetch(now, s.client_id, s.epoch, keys, misses, evictions, waited, prefetched,
                                      s.unused_predictions)
            except OSError as e:   # a full disk must not fail a fetch that is already planned
                log.error("route trace %s: %s; tracing stops", self.live.trace.path, e)
                self.live.trace = None
        s.unused_predictions = 0

    def _auto(self, s: Session, keys, plan, client_started: int, now: float) -> None:
        """The daemon's predictions after ``s``'s fetch (the one call site): learn, propose,
        read BACKGROUND.  The trace gets an ``auto`` line even when empty: it marks where
        the predictor ran, so ``k3d replay`` runs it at the same point.  A fetch it
        skips (``idle``: a token it backed off from) costs it a counter, not measured:
        the two clock reads that would measure it cost more (a system call each)."""
        if self.auto.idle(s.client_id):
            proposed = []
        else:
            t = thread_time_ns()
            proposed, started = self.auto.after_fetch(s.client_id, keys, plan.slots, client_started, now)
            if started:               # (inline reads: finished by ``fetch``, the one caller)
                self._start(started, urgent=False, owner=s.client_id, finish=False)
            self.auto.cpu_ns += thread_time_ns() - t
        if self.live.trace is not None:
            self.live.trace.auto(now, s.client_id, s.epoch, proposed)

    def drop(self, s: Session, reason: str) -> int:
        """``s`` is gone (the caller removes the session).  Returns the pins released."""
        if self.live.trace is not None:
            self.live.trace.bye(time.monotonic(), s.client_id)
        released, _ = self.store.end_epoch(s.client_id, s.holder)
        self.store.forget_client(s.client_id)
        if self.auto is not None:
            t = thread_time_ns()
            self.auto.drop(s.client_id)
            self.auto.cpu_ns += thread_time_ns() - t
        self.store.reuse.leave(s.client_id)
        # Its held-back reads go on as background reads (another client may fetch
        # those keys: that promotes them), never ahead of the urgent reads of others.
        for slot in self.reads.to_background(s.client_id):
            self.store.background(slot)
        self.parked.drop(s, reason)
        return released

    def preload(self, slots: list[int]) -> None:
        """Warm restart: read ``slots`` (``Store.preload``) BACKGROUND, behind every urgent read."""
        self._start(slots, urgent=False)

    def _start(self, slots: list[int], urgent: bool, owner: int | None = None, finish: bool = True) -> None:
        """Start the reads of LOADING ``slots``.  Those read inline are finished here
        (READY before the caller goes on), or with ``finish=False`` by the caller, which
        takes them (``reads.take_inline``) before it answers anything."""
        key_of = self.store.slot_key
        if self.watch is not None and self.watch.changed:
            # a predicted or warm-restart read of a changed file: never started (no
            # fetch waits on it yet; a fetch that needs it fails in ``fetch``)
            kept = []
            for slot in slots:
                msg = self._changed(key_of[slot])
                if msg:
                    self.store.complete(slot, msg, counted=False)
                else:
                    kept.append(slot)
            slots = kept
        self.reads.start([(slot, key_of[slot]) for slot in slots], urgent, owner)
        if finish:
            done = self.reads.take_inline()
            if done is not None:
                self._finish_inline(done)

    def _finish_inline(self, done) -> None:
        """Complete a batch of inline reads (``InlineDone``) in one pass: one sum into the
        counters, one check of their files, one pass making them READY.  As for a
        reader's loads (``_apply``), every byte was read before the files are checked and
        before any slot is READY; a file changed under a read fails that slot (stale,
        counted, logged once by the watch).  No fetch can wait on these slots: each was
        assigned by the request that finishes it, which parks only after this returns."""
        stats = self.stats
        stats.bytes_read += done.nbytes
        stats.read_seconds += done.seconds
        self.recent.add(time.monotonic(), done.nbytes)
        slots = done.slots
        if self.watch is not None:
            self.watch.check(self._files_of(done.keys), paths=False)
            if self.watch.changed:
                ok = []
                for slot, key in zip(slots, done.keys):
                    msg = self._changed(key)
                    if msg:
                        self.store.complete(slot, msg)
                    else:
                        ok.append(slot)
                slots = ok
        self.store.complete_all(slots)

    def _files_of(self, keys) -> list[int]:
        """The files ``keys`` are read from, each once, in order."""
        if len(self.source.files) == 1:
            return [0]
        return sorted({f for key in keys for f in self._files(key)})

    def _files(self, key) -> tuple[int, ...]:
        files = self._key_files.get(key)
        if files is None:
            files = self._key_files[key] = tuple(sorted({e.file for e in self.source.keys[key]}))
        return files

    def _changed(self, key) -> str | None:
        """The message of the first changed file ``key`` is read from (None: none changed)."""
        assert self.watch is not None, "asked only where a file watch saw a change"
        changed = self.watch.changed
        return next((changed[f] for f in self._files(key) if f in changed), None)

    # -- completion ------------------------------------------------------------
    def apply_done(self, draining: bool = False) -> None:
        """Count every part reported; finish every load whose last part came.
        ``draining``: a failed read was cancelled by shutdown (ShuttingDown, not counted)."""
        if self.reads.has_reports():
            self._apply(self.reads.reported(), draining)

    def _apply(self, reports, draining: bool = False) -> None:
        finished = []
        nbytes, seconds, charge = 0, 0.0, self.charge
        for d, load in reports:
            nbytes += d.nbytes
            seconds += d.seconds
            if d.cpu and d.owner is not None and charge is not None:     # (an inline read's is 0)
                charge(d.owner, d.cpu)
            if load is not None:
                finished.append(load)
        # one sum per pass, not one per report: the same totals, at the same time
        self.stats.bytes_read += nbytes
        self.stats.read_seconds += seconds
        self.recent.add(time.monotonic(), nbytes)
        if self.watch is not None and finished:
            # every load's reads have returned: a write that reached any of their bytes
            # has moved its file's identity by now (k3d.sources.identity)
            self.watch.check(self._files_of([load.key for load in finished]), paths=False)
            if self.watch.changed:
                for load in finished:
                    msg = self._changed(load.key)
                    if msg:
                        load.fail, load.stale = msg, True   # a truncated file's EOF error too
        for load in finished:
            self._finished(load, draining)

    def _finished(self, load: Load, draining: bool) -> None:
        cancelled = bool(load.fail) and draining
        self.store.complete(load.slot, load.fail, counted=not cancelled)
        if load.fail and not cancelled and not load.stale:     # a change is logged once, by the watch
            log.warning("read of expert (layer %d, expert %d) failed: %s", *load.key, load.fail)
        self.parked.finished(load, cancelled)

    def shut_down(self) -> None:
        """Cancel queued reads, wait for running ones (30 s at most), answer every parked fetch."""
        if not self.reads.cancel_all():
            log.error("%d reader(s) still busy after 30 s; exiting without waiting for them",
                      self.reads.readers_alive())
        self.apply_done(draining=True)
        self.parked.shut_down()
