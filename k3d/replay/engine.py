"""Replay a route trace through the daemon's own ``Store`` and policy classes.

Nothing here decides a victim: every request goes through ``k3d.cache.store.Store``
(the daemon's pin rules, capacity checks, prediction handling and counters) with a
policy from ``k3d.cache.policy`` (``OptPolicy`` for the bound).  Reads complete at once,
so the result is the deterministic one the daemon reproduces when no background
read is slower than a token (``loading_skips == 0``).

Events come from ``k3d.observe.trace.parse``: fetch (pinned under (client, epoch)),
predict, begin (``end_epoch``), bye.  OPT replays fetches only.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3client.errors import CacheFull
from k3d.cache.policy import make
from k3d.cache.policy.opt import OptPolicy
from k3d.cache.store import Store
from k3d.observe.trace import BEGIN, BYE, FETCH, PREDICT


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

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0

    def as_dict(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                "hit_rate": round(self.hit_rate, 6), "prefetched": self.prefetched,
                "prefetch_hits": self.prefetch_hits, "prefetch_unused": self.prefetch_unused,
                "prefetch_refused": self.prefetch_refused, "bg_evictions": self.bg_evictions,
                "bg_evicted_current": self.bg_evicted_current, "bg_evicted_sooner": self.bg_evicted_sooner}


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
    return best


def run(events, policy: str, slots: int, predictions: bool = True, layers: int | None = None) -> Result:
    """Replay ``events`` with ``slots`` slots under the policy called ``policy`` ("opt": Belady)."""
    layers = layers_of(events) if layers is None else layers
    if policy == "opt":
        pol = OptPolicy([k for ev in events if ev.kind == FETCH for k in ev.keys])
        predictions = False
    else:
        pol = make(policy, layers)
    store = Store(slots, policy=pol)
    epoch: dict[int, int] = {}
    complete = store.complete
    cache_full = 0
    audit = _Audit()
    for ev in events:
        kind, c = ev.kind, ev.client
        if kind == FETCH:
            try:
                plan = store.fetch((c, epoch.get(c, 0)), ev.keys)
            except CacheFull:
                cache_full += 1
                continue
            audit.fetched(c, ev.keys)
            for s in plan.new_loads:
                complete(s, None)
            for s in plan.promote:
                complete(s, None)
        elif kind == PREDICT:
            if predictions:
                before = set(store.key_slot)
                started = store.predict(c, ev.keys)
                if store.stats.evictions:
                    audit.predicted(before - set(store.key_slot), [store.slot_key[s] for s in started])
                for s in started:
                    complete(s, None)
        elif kind == BEGIN:
            audit.token_ends(c)
            e = epoch.get(c, 0)
            store.end_epoch(c, (c, e))
            epoch[c] = e + 1
        elif kind == BYE:
            store.end_epoch(c, (c, epoch.pop(c, 0)))
            store.forget_client(c)
    st = store.stats
    return Result(st.hits, st.misses, st.evictions, st.prefetched, st.prefetch_hits, st.prefetch_unused,
                  st.prefetch_refused, cache_full, audit.evictions, audit.current, audit.sooner)


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
