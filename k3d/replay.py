"""Replay a route trace through the daemon's own ``Store`` and policy classes.

Nothing here decides a victim: every request goes through ``k3d.store.Store``
(the daemon's pin rules, capacity checks, prediction handling and counters) with a
policy from ``k3d.policy`` (``OptPolicy`` for the bound).  Reads complete at once,
so the result is the deterministic one the daemon reproduces when no background
read is slower than a token (``loading_skips == 0``).

Events come from ``k3d.trace.parse``: fetch (pinned under (client, epoch)),
predict, begin (``end_epoch``), bye.  OPT replays fetches only.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3client.errors import CacheFull

from .policy import make
from .policy.opt import OptPolicy
from .store import Store
from .trace import BEGIN, BYE, FETCH, PREDICT


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

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0

    def as_dict(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                "hit_rate": round(self.hit_rate, 6), "prefetched": self.prefetched,
                "prefetch_hits": self.prefetch_hits, "prefetch_unused": self.prefetch_unused}


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
    for ev in events:
        kind, c = ev.kind, ev.client
        if kind == FETCH:
            try:
                plan = store.fetch((c, epoch.get(c, 0)), ev.keys)
            except CacheFull:
                cache_full += 1
                continue
            for s in plan.new_loads:
                complete(s, None)
            for s in plan.promote:
                complete(s, None)
        elif kind == PREDICT:
            if predictions:
                for s in store.predict(c, ev.keys):
                    complete(s, None)
        elif kind == BEGIN:
            e = epoch.get(c, 0)
            store.end_epoch(c, (c, e))
            epoch[c] = e + 1
        elif kind == BYE:
            store.end_epoch(c, (c, epoch.pop(c, 0)))
            store.forget_client(c)
    st = store.stats
    return Result(st.hits, st.misses, st.evictions, st.prefetched, st.prefetch_hits, st.prefetch_unused,
                  st.prefetch_refused, cache_full)
