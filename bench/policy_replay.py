"""Policy figures for the docs (guides/sizing.md, guides/predictions.md): LRU, the default
(cycle), the default with the daemon's own predictor (``coact``: no client predictions in
these traces) and Belady's OPT on real and generated routing, plus replay speed on a ~10^6-access trace and the
predictor's cost per fetch.

Generated traces come from ``k3d.demo.routing.SyntheticRouter`` with other statistics
than the shared Mixtral trace (more experts, top-6/8, other skew and reuse); sizes are
fractions of the model's experts (never below one token's pins).  Everything goes
through ``k3d.replay.engine.run`` (the daemon's Store and policy classes).

    python bench/policy_replay.py [--speed] [--cost] [--targets [TRACE]]

``--speed``: replay time of 1,024,000 accesses per policy, with and without the
predictor (ratio: against the same policy without it, in the same run).
``--cost``: the daemon's per-fetch cost of predicting (``AutoPrefetch.after_fetch``
and ``begin_token``) against ``Store.fetch`` of the same fetches, the daemon's own
planning of a fetch, in the same run; on the shared trace and on generated ones.
Split in two: learning and proposing (the predictor and its glue), and
``Store.predict`` (the read-ahead itself: choosing victims and slots, pinning, the
same work a demand miss of that key would cost the store).
``--targets``: issue 34's gain targets for the predictor on the fine-grained Qwen3
trace (``QWEN3``: ``traces/``, else the shared ``../shared/traces/`` beside the
checkout or its worktree; or TRACE): at 10 % of the experts,
``cycle`` + the predictor >= OPT's hit rate, at 20 % >= 0.95x OPT, with total
reads (misses + reads ahead) <= 1.2x ``cycle`` alone at both.  Deterministic
(replay): no medians needed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from k3d.cache.policy import make  # noqa: E402
from k3d.cache.predict import AutoPrefetch, make as make_predictor  # noqa: E402
from k3d.cache.store import Store  # noqa: E402
from k3d.demo.routing import routes, statistics  # noqa: E402
from k3d.observe.trace import BEGIN, FETCH, read  # noqa: E402
from k3d.replay.engine import experts_of, layers_of, min_slots, run  # noqa: E402

SHARED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "traces", "mixtral8x7b-gsm8k.trace")
TRACES = {   # name: (tokens, router arguments)
    "mixtral-like L32 E8 k2": (400, dict(layers=32, experts=8, topk=2, seed=3)),
    "olmoe-like L16 E64 k8, rho 0.3": (300, dict(layers=16, experts=64, topk=8, seed=4, rho=0.3)),
    "L24 E64 k8": (200, dict(layers=24, experts=64, topk=8, seed=4)),
    "dsv2lite-like L26 E64 k6, flat": (200, dict(layers=26, experts=64, topk=6, seed=6, skew=0.2, rho=0.5)),
    "qwen3-like L48 E128 k8, skewed, high reuse": (150, dict(layers=48, experts=128, topk=8, seed=5, skew=1.0,
                                                             rho=0.9)),
}
FRACTIONS = (0.25, 0.3, 0.4, 0.5, 0.6, 0.75)
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN3 = next((p for p in (os.path.join(_ROOT, *up, "traces", "qwen3-30b-a3b-k6.trace")
                          for up in ((), ("..", "shared"), ("..", "..", "shared")))
              if os.path.exists(p)), os.path.join(_ROOT, "traces", "qwen3-30b-a3b-k6.trace"))
TARGETS = ((0.10, 1.0), (0.20, 0.95))   # (share of experts, least share of OPT's hit rate)
READS = 1.2                             # total reads at most this many times cycle's alone


def write_trace(path: str, tokens: int, predict: bool = False, **kw) -> dict:
    r, p = routes(tokens, **kw)
    with open(path, "w") as f:
        for t in range(tokens):
            for layer in range(r.shape[1]):
                f.write(f"{t} c=1 t={t} L{layer} n={r.shape[2]} " + " ".join(map(str, r[t, layer])) + "\n")
                if predict and layer + 1 < r.shape[1]:
                    f.write(f"{t} c=1 t={t} predict " + " ".join(f"{layer + 1}:{e}" for e in p[t, layer]) + "\n")
            f.write(f"{t} c=1 t={t} begin\n")
    return statistics(r, kw["experts"])


def table(name: str, events, experts: int) -> None:
    L = layers_of(events)
    floor = min_slots(events)
    sizes = sorted({max(floor, int(f * L * experts)) for f in FRACTIONS})
    print(f"\n{name}: {L} layers x {experts} experts, one token pins up to {floor}")
    print(f"{'slots':>6} {'lru':>7} {'cycle':>7} {'+coact':>7} {'opt':>7} {'cycle-lru':>10} "
          f"{'+coact/opt':>10} {'read ahead':>10} {'unused':>7}")
    for s in sizes:
        r = {p: 100 * run(events, p, s, predictions=False, layers=L, predictor="none").hit_rate
             for p in ("lru", "cycle", "opt")}
        a = run(events, "cycle", s, predictions=False, layers=L, predictor="coact")
        unused = f"{100 * a.prefetch_unused / a.prefetched:6.1f}%" if a.prefetched else "      -"
        print(f"{s:>6} {r['lru']:6.1f}% {r['cycle']:6.1f}% {100 * a.hit_rate:6.1f}% {r['opt']:6.1f}% "
              f"{r['cycle'] - r['lru']:+9.1f} {a.hit_rate * 100 / r['opt']:10.2f} {a.prefetched:>10} {unused}",
              flush=True)


def speed(tmp: str) -> None:
    path = os.path.join(tmp, "big.trace")
    write_trace(path, 4000, layers=32, experts=64, topk=8, seed=9)      # 1,024,000 accesses
    t0 = time.perf_counter()
    events = read(path)
    parse_s = time.perf_counter() - t0
    n = sum(len(e.keys) for e in events if e.kind == "fetch")
    print(f"\nspeed: {n} accesses, parsed in {parse_s:.1f}s")
    floor = {}
    for p, pred in (("lru", "none"), ("lru", "coact"), ("cycle", "none"), ("cycle", "coact"), ("opt", "none")):
        t0, c0 = time.perf_counter(), time.process_time()
        r = run(events, p, 1024, predictions=False, predictor=pred)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        floor.setdefault(p, cpu)
        ratio = f", {cpu / floor[p]:.2f}x {p} alone" if pred != "none" else ""
        p = p if pred == "none" else f"{p}+{pred}"
        print(f"  {p:<12} 1024 slots: {dt:5.1f}s wall, {cpu:5.1f}s CPU ({n / cpu / 1e3:.0f}k accesses per CPU second"
              f"{ratio}), hit rate {100 * r.hit_rate:.1f}%, read ahead {r.prefetched}", flush=True)


class _TimedPredict:
    """The store as the predictor sees it, its ``predict`` (the read-ahead itself: victims,
    slots, pins) timed into ``acc``.  A wrapper, not a replaced method: a compiled
    ``Store`` takes no new attribute (k3d.compiled)."""

    def __init__(self, store, clock, acc: list) -> None:
        self._store, self._clock, self._acc = store, clock, acc

    def predict(self, *a):
        t0 = self._clock()
        try:
            return self._store.predict(*a)
        finally:
            self._acc[0] += self._clock() - t0

    def __getattr__(self, name):
        return getattr(self._store, name)


def cost(name: str, events, slots: int) -> None:
    """The daemon's calls, timed: ``Store.fetch`` (the floor) and the predictor's hooks."""
    L, E = layers_of(events), experts_of(events)
    store = Store(slots, policy=make("cycle", L))
    auto = AutoPrefetch(store, make_predictor("coact", L, E))
    epoch: dict[int, int] = {}
    t_fetch = t_pred = 0.0
    fetches = 0
    clock = time.perf_counter
    t_read = [0.0]
    auto.store = _TimedPredict(store, clock, t_read)
    for ev in events:
        c = ev.client
        if ev.kind == FETCH:
            t0 = clock()
            plan = store.fetch((c, epoch.get(c, 0)), ev.keys)
            t1 = clock()
            for s in plan.new_loads + plan.promote:
                store.complete(s, None)
            t2 = clock()
            _, started = auto.after_fetch(c, ev.keys, plan.slots)
            t3 = clock()
            t_fetch += t1 - t0
            t_pred += t3 - t2
            fetches += 1
        elif ev.kind == BEGIN:
            store.end_epoch(c, (c, epoch.get(c, 0)))
            epoch[c] = epoch.get(c, 0) + 1
            t2 = clock()
            auto.end_token(c)
            _, started = auto.begin_token(c)
            t_pred += clock() - t2
        else:
            continue
        for s in started:
            store.complete(s, None)
    us = 1e6 / max(fetches, 1)
    learn = t_pred - t_read[0]
    print(f"  {name:<42} {slots:>5} slots: Store.fetch {t_fetch * us:6.1f} us | learn+propose {learn * us:5.1f} us "
          f"({learn / t_fetch:.2f}x), + Store.predict {t_read[0] * us:5.1f} us = {t_pred * us:5.1f} us "
          f"({t_pred / t_fetch:.2f}x) per fetch | read ahead {auto.totals().prefetched}", flush=True)


def targets(path: str) -> bool:
    """Issue 34's rows on ``path``: LRU, cycle, OPT, cycle + the predictor, the reads ratio."""
    events = read(path)
    L, E = layers_of(events), experts_of(events)
    print(f"targets: {os.path.basename(path)}, {L} layers x {E} experts, "
          f"{sum(len(e.keys) for e in events if e.kind == FETCH)} accesses")
    print(f"{'share':>6} {'slots':>6} {'lru':>6} {'cycle':>6} {'opt':>6} {'+coact':>7} {'/opt':>6} "
          f"{'reads/cycle':>11} {'read ahead':>10} {'unused':>7}")
    ok = True
    for share, least in TARGETS:
        s = int(round(share * L * E))
        r = {p: run(events, p, s, predictions=False, layers=L, predictor="none") for p in ("lru", "cycle", "opt")}
        a = run(events, "cycle", s, predictions=False, layers=L, predictor="coact")
        gain, reads = a.hit_rate / r["opt"].hit_rate, (a.misses + a.prefetched) / r["cycle"].misses
        good = gain >= least - 1e-9 and reads <= READS
        ok &= good
        print(f"{share:6.0%} {s:>6} {100 * r['lru'].hit_rate:5.1f}% {100 * r['cycle'].hit_rate:5.1f}% "
              f"{100 * r['opt'].hit_rate:5.1f}% {100 * a.hit_rate:6.1f}% {gain:6.3f} {reads:11.2f} "
              f"{a.prefetched:>10} {a.prefetch_unused:>7}  (targets >= {least}x opt, <= {READS}x reads) "
              f"{'PASS' if good else 'FAIL'}", flush=True)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--speed", action="store_true", help="only the ~10^6-access speed run")
    ap.add_argument("--cost", action="store_true", help="only the predictor's cost per fetch")
    ap.add_argument("--targets", nargs="?", const=QWEN3, default=None, metavar="TRACE",
                    help=f"only issue 34's predictor targets on the Qwen3 trace (default {QWEN3})")
    args = ap.parse_args()
    if args.targets:
        targets(args.targets)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        if args.cost:
            print("cost per fetch (cycle; the predictor's hooks against Store.fetch of the same fetches):")
            if os.path.exists(SHARED):
                cost("shared Mixtral-8x7B GSM8K trace", read(SHARED), 100)
            if os.path.exists(QWEN3):           # (10 % of the experts: the predictor reads ahead most here)
                cost("shared Qwen3-30B-A3B trace", read(QWEN3), 614)
            for name, (tokens, kw) in TRACES.items():
                path = os.path.join(tmp, "t.trace")
                write_trace(path, tokens, **kw)
                cost(name, read(path), int(0.4 * kw["layers"] * kw["experts"]))
            return 0
        if args.speed:
            speed(tmp)
            return 0
        if os.path.exists(SHARED):
            table("shared Mixtral-8x7B GSM8K trace", read(SHARED), 8)
        for name, (tokens, kw) in TRACES.items():
            path = os.path.join(tmp, "t.trace")
            st = write_trace(path, tokens, **kw)
            print(f"\n[{name}] reuse {st['reuse_ratio']:.2f}x chance, busiest expert {st['busiest_vs_mean']:.2f}x mean")
            table(name, read(path), kw["experts"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
