"""Store path: the daemon's plan of a fetch at real key counts, in-process, vs a plain LRU dict.

    python bench/store_path.py [--layers 58] [--experts 256] [--topk 8] [--share 0.3]
                               [--clients 2] [--tokens 60] [--warm 10] [--reps 5] [--policy cycle]
                               [--hit-path] [--bytecodes]

What ``bench/scale.py`` cannot separate from sockets, reads and wake-ups: the Python
cost of the store and its policy per fetch (``k3d.cache.store.Store``: a fetch's plan,
its evictions, the policy's victims, pins, predictions, the end of each token's pins),
with no I/O.  Requests are ``scale.py``'s: ``clients`` streams of ``SyntheticRouter``
text (58 x 256 top-8 by default), per token one ``end_epoch`` per client and per
layer one ``fetch`` of the top-k and one ``predict`` of the gate-ahead guess for the
next layer, every read completed at once.

``--hit-path``: the clients answer hits themselves, as k3client does by default, so the
store evicts ahead (``make_room``) and a fetch takes free slots.  As the daemon does,
each request is bracketed by ``reuse.waiting``/``replied`` (the other clients' next
messages say ``seen``), a refused fetch (``SlotsBusy``) is retried, and each request is
followed by ``settle``'s reclaim and evictions ahead.  Without it, every victim is
chosen inside a fetch or a prediction (one client, or clients asking for every key).

``--bytecodes``: instead of timing, one rep's measured tokens run under a tracer that
counts the Python bytecodes executed per fetch (``sys.settrace`` with
``f_trace_opcodes``): slow, but a figure that does not move with the machine's load,
for comparing two trees a few per cent apart (bench/README.md, "the cycle policy's
victims").

Floor, same run, same requests: a plain LRU cache in an ``OrderedDict`` of the same
number of slots (a hit moves to the end, a miss or a prediction not resident evicts the
first): the least a cache of these keys must do per fetch in Python.  Reps alternate
store and floor; reported: the store's and the floor's time per fetch (the token's
``end_epoch`` included), the median of the per-rep ratios, and both hit rates.

Deterministic requests, one process, no sockets: the figure moves little with load
(quote the median of the ratios and the CPU).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import OrderedDict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402

from k3client.errors import SlotsBusy  # noqa: E402
from k3d.cache import policy as policies  # noqa: E402
from k3d.cache.reuse import Reuse, reserve_for  # noqa: E402
from k3d.cache.store import Store  # noqa: E402
from k3d.config import Config  # noqa: E402
from k3d.demo.routing import SyntheticRouter  # noqa: E402


def requests(a, rep: int):
    """Per token, per client: the top-k of each layer and the gate-ahead guess made with it."""
    routers = [SyntheticRouter(a.layers, a.experts, a.topk, seed=0, stream=rep * a.clients + c)
               for c in range(a.clients)]
    return [[r.token() for r in routers] for _ in range(a.warm + a.tokens)]


class HitPath:
    """``--hit-path``: the requests of clients that answer hits themselves, around the
    store as the daemon's loop puts them (module docstring)."""

    def __init__(self, store: Store, clients: int):
        self.store, self.rid = store, 0
        for c in range(clients):
            store.reuse.attach(c)

    def request(self, c: int, handle, *args) -> None:
        store, reuse = self.store, self.store.reuse
        while True:
            self.rid += 1
            reuse.waiting(c, self.rid)
            try:
                handle(*args)
                ok = True
            except SlotsBusy:                  # the client retries after settle made room
                ok = False
            reuse.replied(c, self.rid, ok=ok)
            for other in reuse.viewers:        # their next messages report what they saw
                if other != c:
                    reuse.seen(other, reuse.retired)
            if reuse.limbo:
                store.reclaim(0.0)
            if store.want or store.pressed > -1.0:
                store.make_room(0.0)
            if ok:
                return


class Bytecodes:
    """A ``sys.settrace`` tracer counting the bytecodes run in the frames it sees."""

    def __init__(self):
        self.n = 0

    def __call__(self, frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            self.n += 1
        return self


def run_store(a, slots: int, drawn, count: Bytecodes | None = None) -> tuple[float, float]:
    """Seconds per fetch over the measured tokens, and the hit rate; with ``count``, the
    measured tokens' calls run under it (counting bytecodes: the seconds are not real)."""
    store = Store(slots, policy=policies.make(a.policy, layers=a.layers), reuse=Reuse(),
                  reserve=reserve_for(slots))
    hit_path = HitPath(store, a.clients) if a.hit_path else None
    pc = time.perf_counter
    t0, h0, m0 = 0.0, 0, 0

    def fetch(c: int, t: int, layer: int, route, pred) -> None:
        plan = store.fetch((c, t), [(layer, e) for e in route[layer]])
        for s in plan.new_loads:
            store.complete(s, None)
        if pred[layer]:
            for s in store.predict(c, [(layer + 1, e) for e in pred[layer]]):
                store.complete(s, None)

    for t, clients in enumerate(drawn):
        if t == a.warm:
            t0, h0, m0 = pc(), store.stats.hits, store.stats.misses
            if count is not None:
                sys.settrace(count)                # (frames called from here on: the store's)
        for c in range(a.clients):
            if hit_path is None:
                store.end_epoch(c, (c, t - 1))
            else:
                hit_path.request(c, store.end_epoch, c, (c, t - 1))
        for layer in range(a.layers):
            for c, (route, pred) in enumerate(clients):
                if hit_path is None:
                    fetch(c, t, layer, route, pred)
                else:
                    hit_path.request(c, fetch, c, t, layer, route, pred)
    sys.settrace(None)
    dt = pc() - t0
    hits, misses = store.stats.hits - h0, store.stats.misses - m0
    return dt / (a.tokens * a.clients * a.layers), hits / max(1, hits + misses)


def run_floor(a, slots: int, drawn) -> tuple[float, float]:
    """The same requests through a plain LRU ``OrderedDict`` of ``slots`` keys."""
    cache: OrderedDict = OrderedDict()
    pc = time.perf_counter
    t0, hits, misses = 0.0, 0, 0
    for t, clients in enumerate(drawn):
        if t == a.warm:
            t0, hits, misses = pc(), 0, 0
        for layer in range(a.layers):
            for route, pred in clients:
                for e in route[layer]:
                    key = (layer, e)
                    if key in cache:
                        cache.move_to_end(key)
                        hits += 1
                    else:
                        if len(cache) >= slots:
                            cache.popitem(last=False)
                        cache[key] = True
                        misses += 1
                for e in pred[layer] or ():
                    key = (layer + 1, e)
                    if key not in cache:
                        if len(cache) >= slots:
                            cache.popitem(last=False)
                        cache[key] = True
    dt = pc() - t0
    return dt / (a.tokens * a.clients * a.layers), hits / max(1, hits + misses)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.scale_shape(ap)
    ap.add_argument("--tokens", type=int, default=60, help="measured tokens per client per rep")
    ap.add_argument("--warm", type=int, default=10, help="tokens per client before the clock")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--policy", default=Config.policy, help="the daemon's --policy (default: its default)")
    ap.add_argument("--hit-path", action="store_true",
                    help="the clients answer hits themselves: the store evicts ahead (make_room)")
    ap.add_argument("--bytecodes", action="store_true",
                    help="count the Python bytecodes per fetch of one rep instead of timing (slow, load-proof)")
    a = ap.parse_args()
    n_keys = a.layers * a.experts
    slots = max(a.topk * a.clients * 2, int(a.share * n_keys))
    mode = f"policy {a.policy}{', hit path' if a.hit_path else ''}"
    harness.banner("store_path", f"{a.layers} x {a.experts} top-{a.topk}, {slots} slots ({slots / n_keys:.0%}), "
                   f"{a.clients} clients, {mode}; load {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    if a.bytecodes:
        count = Bytecodes()
        _, hit = run_store(a, slots, requests(a, 0), count)
        print(f"store_path: {mode}, {a.tokens} tokens x {a.clients} clients: "
              f"{count.n / (a.tokens * a.clients * a.layers):.0f} bytecodes per fetch, hit rate {hit:.1%}")
        return 0
    per, flo, ratios = [], [], []
    for r in range(a.reps):
        drawn = requests(a, r)
        s, s_hit = run_store(a, slots, drawn)
        f, f_hit = run_floor(a, slots, drawn)
        per.append(s)
        flo.append(f)
        ratios.append(s / f)
        harness.banner("store_path", f"rep {r + 1}/{a.reps}: store {s * 1e6:.1f} us/fetch (hit rate {s_hit:.1%}) | "
                       f"LRU dict {f * 1e6:.1f} us/fetch ({f_hit:.1%}) | ratio {s / f:.1f} | "
                       f"load {os.getloadavg()[0]:.1f}")
    print(f"store_path: {a.layers} x {a.experts} top-{a.topk}, {slots / n_keys:.0%} slots, {a.clients} clients, "
          f"{mode}, "
          f"{a.reps} reps x {a.tokens} tokens; medians")
    print(f"store_path: store {harness.median(per) * 1e6:.1f} us per fetch, LRU dict floor "
          f"{harness.median(flo) * 1e6:.1f} us, ratio {harness.median(ratios):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
