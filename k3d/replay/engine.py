"""Replay a route trace through the daemon's own ``Store`` and policy classes.

Nothing here decides a victim: every request goes through ``k3d.cache.store.Store``
(the daemon's pin rules, capacity checks, prediction handling and counters) with a
policy from ``k3d.cache.policy`` (``OptPolicy`` for the bound).  Reads complete at once,
so the result is the deterministic one the daemon reproduces when no background
read is slower than a token (``loading_skips == 0``).

Events come from ``k3d.observe.trace.parse``: fetch (pinned under (client, epoch)),
predict, done (``release_layers``: the client's pins of those layers go), begin
(``end_epoch``), bye.  OPT replays fetches only.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3client.errors import CacheFull
from k3d.cache.policy import make
from k3d.cache.policy.opt import OptPolicy
from k3d.cache.predict import AutoPrefetch, auto_id, make as make_predictor
from k3d.cache.predict.private import PerClient
from k3d.cache.store import Store
from k3d.observe.stats import PredictionStats
from k3d.observe.trace import AUTO, BEGIN, BYE, DONE, FETCH, PREDICT


class ReplayError(ValueError):
    pass


@dataclass
class Result:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    prefetched: int = 0
    prefetch_hits: int = 0
    prefetch_unused: int = 0
    prefetch_refused: int = 0
    cache_full: int = 0
    bg_evictions: int = 0           # evictions made by background reads (predictions)
    bg_evicted_current: int = 0     # ... of an expert the current token of any client used
    bg_evicted_sooner: int = 0      # ... of an expert requested again before the prediction was used
    prefetch_ready: int = 0         # prefetch_hits whose read was done before the request (read model)
    prefetch_waited: int = 0        # ... whose request waited for the read
    auto_prefetched: int = 0        # the daemon's own predictions (included in prefetched)
    auto_hits: int = 0
    auto_unused: int = 0

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0

    def as_dict(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                "hit_rate": round(self.hit_rate, 6), "prefetched": self.prefetched,
                "prefetch_hits": self.prefetch_hits, "prefetch_unused": self.prefetch_unused,
                "prefetch_refused": self.prefetch_refused, "bg_evictions": self.bg_evictions,
                "bg_evicted_current": self.bg_evicted_current, "bg_evicted_sooner": self.bg_evicted_sooner,
                "prefetch_ready": self.prefetch_ready, "prefetch_waited": self.prefetch_waited,
                "auto_prefetched": self.auto_prefetched, "auto_hits": self.auto_hits,
                "auto_unused": self.auto_unused}


def layers_of(events) -> int:
    return 1 + max((k[0] for ev in events for k in ev.keys), default=0)


def min_slots(events) -> int:
    """The most keys pinned at once by fetches alone: fewer slots cannot serve the trace."""
    held: dict[int, set] = {}
    total = best = 0
    for ev in events:
        if ev.kind == FETCH:
            mine = held.setdefault(ev.client, set())
            before = len(mine)
            mine.update(ev.keys)
            total += len(mine) - before
            best = max(best, total)
        elif ev.kind in (BEGIN, BYE):
            total -= len(held.pop(ev.client, ()))
        elif ev.kind == DONE and ev.client in held:
            mine = held[ev.client]
            gone = {k for k in mine if k[0] in ev.layers}
            mine -= gone
            total -= len(gone)
    return best


def experts_of(events) -> int:
    return 1 + max((k[1] for ev in events for k in ev.keys), default=0)


def run(events, policy: str, slots: int, predictions: bool = True, layers: int | None = None,
        predictor: str | None = None, read_lead: int = 1, budget: int = 0, experts: int | None = None,
        learn: str = "shared") -> Result:
    """Replay ``events`` with ``slots`` slots under the policy called ``policy`` ("opt": Belady).

    ``predictor``: the daemon's own predictions.  None: the trace's ``auto`` lines as
    recorded; "none": none; a name from ``k3d.cache.predict.PREDICTORS``: that class,
    run through ``AutoPrefetch`` (as the daemon does) where the trace's ``auto`` lines
    say the daemon ran it (after a fetch, or after a ``begin``: the token's first
    layer), else right after each fetch and its ``predict`` line, and after each
    ``begin``.  ``learn``: "shared" (the daemon: one predictor learns from every
    client) or "private" (one predictor per client, ``PerClient``: the counterfactual
    that tells what sharing what was learned is worth).
    ``read_lead``: a used prediction was ready before the request when at least this
    many fetches came between it and its use, else its request waited (reads
    complete at once here, so this is the model of read time)."""
    layers = layers_of(events) if layers is None else layers
    if policy == "opt":
        pol = OptPolicy([k for ev in events if ev.kind == FETCH for k in ev.keys])
        predictions, predictor = False, "none"
    else:
        pol = make(policy, layers)
    evicted = _Evicted()
    store = Store(slots, policy=pol, index=evicted)
    auto = None
    if predictor not in (None, "none"):
        E = experts_of(events) if experts is None else experts
        if learn == "private":
            model = PerClient(lambda: make_predictor(predictor, layers, E))
        elif learn == "shared":
            model = make_predictor(predictor, layers, E)
        else:
            raise ValueError(f"learn: shared or private, not {learn!r}")
        auto = AutoPrefetch(store, model, budget=budget, read_lead=read_lead)
    marked = auto is not None and any(ev.kind == AUTO for ev in events)
    epoch: dict[int, int] = {}
    complete = store.complete
    cache_full = 0
    audit = _Audit()
    timing = _Timing(store, read_lead)
    pending = None                  # [client, keys, slots, client predictions started, predict line seen]
    begun = None                    # the client whose begin line came last (marked traces)

    def predict(client, keys):
        evicted.keys.clear()
        return issued(store.predict(client, keys))

    def issued(started):
        if evicted.keys:            # the keys background reads evicted, and still gone
            key_slot = store.key_slot
            audit.predicted({k for k in evicted.keys if k not in key_slot}, [store.slot_key[s] for s in started])
        for s in started:
            complete(s, None)
        timing.issued(started)
        return started

    def flush(predict=True):
        nonlocal pending
        c, keys, got, n, _ = pending
        pending = None
        evicted.keys.clear()
        issued(auto.after_fetch(c, keys, got, n, predict=predict)[1])

    def begin_token(c):
        evicted.keys.clear()
        issued(auto.begin_token(c)[1])

    for ev in events:
        kind, c = ev.kind, ev.client
        if begun is not None:       # the daemon predicted the token's first layer where an auto line follows
            b, begun = begun, None
            if kind == AUTO and c == b:
                begin_token(c)
                continue
        if pending is not None:
            if kind == PREDICT and c == pending[0] and not pending[4]:
                pending[4] = True       # the fetch's own predicted= keys come first
                if predictions:
                    pending[3] += len(predict(c, ev.keys))
                continue
            if not marked:
                flush()
            else:       # the daemon ran its predictor where an auto line follows; else (a
                flush(predict=kind == AUTO and c == pending[0])   # reported fetch) it only learned
        if kind == FETCH:
            try:
                timing.fetching(ev.keys)
                evicted.keys.clear()        # (a demand miss's evictions: not the audit's)
                plan = store.fetch((c, epoch.get(c, 0)), ev.keys)
            except CacheFull:
                cache_full += 1
                continue
            audit.fetched(c, ev.keys)
            for s in plan.new_loads:
                complete(s, None)
            for s in plan.promote:
                complete(s, None)
            if auto is not None:
                pending = [c, ev.keys, plan.slots, 0, False]
        elif kind == DONE:
            store.release_layers((c, epoch.get(c, 0)), set(ev.layers))
        elif kind == PREDICT:
            if predictions:
                predict(c, ev.keys)
        elif kind == AUTO:
            if predictor is None and ev.keys:
                predict(auto_id(c), ev.keys)
        elif kind == BEGIN:
            audit.token_ends(c)
            e = epoch.get(c, 0)
            store.end_epoch(c, (c, e))
            store.end_epoch(auto_id(c), None)
            epoch[c] = e + 1
            if auto is not None:
                auto.end_token(c)
                if marked:
                    begun = c
                else:
                    begin_token(c)
        elif kind == BYE:
            store.end_epoch(c, (c, epoch.pop(c, 0)))
            store.forget_client(c)
            store.end_epoch(auto_id(c), None)
            if auto is not None:
                auto.drop(c)
    if pending is not None:
        flush(predict=not marked)
    st = store.stats
    daemon = PredictionStats()
    for cid, q in [*store.book.quality.items(), (-1, auto.gone if auto else PredictionStats())]:
        if cid < 0:
            for name in vars(q):
                setattr(daemon, name, getattr(daemon, name) + getattr(q, name))
    return Result(st.hits, st.misses, st.evictions, st.prefetched, st.prefetch_hits, st.prefetch_unused,
                  st.prefetch_refused, cache_full, audit.evictions, audit.current, audit.sooner,
                  timing.ready, timing.waited, daemon.prefetched, daemon.prefetch_hits, daemon.prefetch_unused)


class _Evicted:
    """The store's index here: notes the keys that leave the cache (``clear``), so the
    audit of a background read knows which it evicted without a copy of every slot's
    key per fetch.  The caller empties ``keys`` before the read.  Not a subclass of
    ``NoIndex``: a compiled class takes none from interpreted code (``k3d.compiled``)."""

    def __init__(self) -> None:
        self.keys: list = []

    def loading(self, key, slot: int) -> None:
        pass

    def ready(self, key, slot: int) -> None:
        pass

    def retired(self) -> None:
        return None

    def clear(self, key) -> None:
        self.keys.append(key)


class _Timing:
    """The read-time model: a used prediction was ready if ``lead`` fetches came between."""

    def __init__(self, store, lead: int):
        self.store, self.lead = store, lead
        self.n = 0
        self.at: dict[int, int] = {}      # predicted slot -> fetch count when predicted
        self.ready = self.waited = 0

    def issued(self, slots) -> None:
        for s in slots:
            self.at[s] = self.n

    def fetching(self, keys) -> None:
        self.n += 1
        st = self.store
        if not st.book.predicted_by:              # (no prediction waits: nothing to count)
            return
        for k in keys:
            s = st.key_slot.get(k)
            if s is not None and s in st.book.predicted_by:
                if self.n - self.at.get(s, self.n) >= self.lead:
                    self.ready += 1
                else:
                    self.waited += 1


class _Audit:
    """Checks on background reads: whom did a prediction evict, and was it worth it?

    A victim counts ``current`` if any client's current token used it, and ``sooner``
    if it is requested again before the prediction that displaced it is used (or
    before that prediction is found unused at its client's next token)."""

    def __init__(self):
        self.evictions = self.current = self.sooner = 0
        self.token: dict[int, set] = {}           # client -> keys its current token used
        self.watch: dict[tuple, list] = {}        # evicted key -> [prediction keys it waits on]
        self.waiting: dict[tuple, set] = {}       # prediction key -> evicted keys watching it

    def fetched(self, client, keys) -> None:
        self.token.setdefault(client, set()).update(keys)
        if not (self.watch or self.waiting):      # (no victim of a prediction watched)
            return
        for k in keys:
            if k in self.watch:                   # a victim came back first
                self.sooner += 1
                for p in self.watch.pop(k):
                    self.waiting.get(p, set()).discard(k)
            for v in self.waiting.pop(k, ()):     # the prediction was used first
                self.watch.pop(v, None)

    def predicted(self, evicted, started) -> None:
        self.evictions += len(evicted)
        used = set().union(*self.token.values()) if self.token else set()
        self.current += len(evicted & used)
        for v in evicted:
            self.watch[v] = list(started)
            for p in started:
                self.waiting.setdefault(p, set()).add(v)

    def token_ends(self, client) -> None:
        self.token.pop(client, None)
