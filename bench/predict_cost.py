"""The daemon's own predictor, what it costs per fetch: a real daemon's CPU with
``--predict auto`` beside the same daemon with ``--predict client``.

    python bench/predict_cost.py [--reps 3] [--hit-path client|daemon] [--slots 100]

One k3client client replays the real routing trace ``traces/mixtral8x7b-gsm8k.trace``
(244 tokens x 32 layers, top-2 of 8: 7,808 fetches; ``begin_token()`` at each token)
into a fresh daemon on a synthetic checkpoint of the same shape (256 experts of
51 KiB: reads are real but cheap) with a 100-slot arena, so there are misses and
room to read ahead.  The client sends no predictions of its own.  With the default
``--hit-path client`` (what users get) fetches of resident experts are answered in
the client and reported with the next request: the daemon learns from those but
predicts only at the fetches that reach it; ``--hit-path daemon`` sends every fetch.

Figure: the daemon process's CPU (every thread, from the scheduler's per-thread
run times: loop_cost's ``cpu()``), and its loop thread's, over the whole replay
(up to the last read ahead landing) divided by the fetches.  Floor, in the same
run: the ``--predict client`` daemon on the same stream, the same daemon without
its predictor.  Runs alternate auto/client (the order swapped each rep), so drift
hits both; figures are medians over ``--reps``, the difference and the ratio
(difference / client's CPU per fetch: the predictor's cost against a fetch) medians
of the per-rep (same-run) values.

The difference is the whole daemon's, the honest user-facing cost: beside
learning and proposing, the predictor changes the work itself (reads ahead are
extra reads, hits it brings are reads moved earlier, and hits answered in the
client are round trips the loop never sees).  The hit rates, reads and the
daemon's prediction counters (``status()``, last run of each mode) say what it buys.

The predictor's own CPU, timed where it runs: the daemon's loop thread adds its
CPU in the predictor's hooks and in starting their reads to ``status()``'s
``prediction.daemon.cpu_s`` (``k3d.cache.fetch``).  Against the rest of the same
``auto`` run's daemon CPU (the floor, in the same run: no drift between runs),
it is far less noisy than the difference above, and leaves out what the reads
ahead themselves cost (extra reads, reported as bytes read for nothing).
``--hidden 2880 --inter 2880``: experts of gpt-oss's size (~13 MB in MXFP4), where a
fetch's reads cost what they cost users.

``--router L,E,K [--tokens N] [--share F]``: instead of the Mixtral trace,
``k3d.demo.routing.routes`` at a fine-grained shape (e.g. ``58,256,8``: DeepSeek-V3's
counts), an arena of ``F`` of the experts (default 0.3).  The daemon's RSS at the
end of each replay is printed too, with auto's against client's.

Target (issue 34): where the predictor raises the hit rate by under 2 points, auto
costs <= 1.15x client's daemon CPU per fetch and RSS (it backs off:
``k3d.cache.predict.prefetch``; ``skip`` in the last line says how far).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
import psutil  # noqa: E402
from loop_cost import measured  # noqa: E402

import k3client  # noqa: E402
from k3d.demo.routing import routes  # noqa: E402
from k3d.observe.trace import BEGIN, FETCH, read  # noqa: E402

TRACE = os.path.join(harness.ROOT, "traces", "mixtral8x7b-gsm8k.trace")
MODES = ("auto", "client")


def replay_once(ckpt: str, mode: str, slots: int, hit_path: str, stream) -> tuple[float, float, float, dict]:
    """(daemon CPU s/fetch, loop thread CPU s/fetch, wall s, status) of one replay
    of ``stream`` into a fresh daemon with ``--predict mode``."""
    fetches = sum(1 for op, _ in stream if op == FETCH)
    with harness.Daemon(ckpt, "--slots", slots, "--predict", mode, "--log-level", "warning") as d, \
            k3client.connect(d.endpoint, name="replay", hit_path=hit_path) as c:
        if c.hit_path != hit_path:
            raise RuntimeError(f"hit path {c.hit_path}, not {hit_path}: {c.hit_path_why}")
        c.status()                          # connected and answered before the clock starts

        def replay():
            for op, arg in stream:
                if op == FETCH:
                    c.fetch(*arg)
                else:
                    c.begin_token()
            c.begin_token()                 # the last token's hits reported
            while c.status()["arena"]["loading"]:   # reads ahead still landing count too
                time.sleep(0.002)

        t0 = time.perf_counter()
        proc = psutil.Process(d.pid)
        proc_s, main_s = measured(proc, replay, fetches)
        wall = time.perf_counter() - t0
        st = c.status()
        st["rss"] = proc.memory_info().rss
        return proc_s, main_s, wall, st


def bought(st: dict) -> str:
    s = st["stats"]
    hit = 100 * s["hits"] / max(1, s["hits"] + s["misses"])
    line = (f"hit rate {hit:.1f}% ({s['hits']} hits, {s['misses']} misses, {s['client_hits']} answered in the "
            f"client), {s['misses'] + s['prefetched']} reads, {s['evictions']} evictions")
    dp = st.get("prediction", {}).get("daemon")
    if dp:
        prec = dp["precision"]
        line += (f"; daemon predictions ({dp['predictor']}): issued {dp['issued']}, used {dp['used']} "
                 f"({dp['used_late']} late), unused {dp['unused']}, precision "
                 f"{'-' if prec is None else f'{prec:.2f}'}")
    return line


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hit-path", choices=("client", "daemon"), default="client")
    ap.add_argument("--slots", type=int, default=100)
    ap.add_argument("--hidden", type=int, default=256, help="expert shape (MXFP4); 2880 x 2880: gpt-oss's")
    ap.add_argument("--inter", type=int, default=128)
    ap.add_argument("--router", default=None, help="L,E,K: synthetic routing at this shape instead of the trace")
    ap.add_argument("--tokens", type=int, default=300, help="--router: tokens")
    ap.add_argument("--share", type=float, default=0.3, help="--router: the arena's share of the experts")
    a = ap.parse_args()
    print(f"[predict_cost] k3d {harness.build()}", flush=True)
    stream = []
    if a.router:
        layers, experts, topk = (int(x) for x in a.router.split(","))
        route, _ = routes(a.tokens, layers=layers, experts=experts, topk=topk, seed=3)
        for token in route.tolist():
            stream += [(FETCH, (layer, picks)) for layer, picks in enumerate(token)] + [(BEGIN, None)]
        a.slots = int(a.share * layers * experts)
        source = f"routes({a.tokens} tokens, {layers}x{experts} top-{topk})"
    else:
        events = read(TRACE)
        for e in events:
            if e.kind == FETCH:
                stream.append((FETCH, (e.keys[0][0], [x for _, x in e.keys])))
            elif e.kind == BEGIN:
                stream.append((BEGIN, None))
        layers = 1 + max(k[0] for e in events if e.kind == FETCH for k in e.keys)
        experts = 1 + max(k[1] for e in events if e.kind == FETCH for k in e.keys)
        source = os.path.basename(TRACE)
    fetches = sum(1 for op, _ in stream if op == FETCH)
    ckpt = harness.checkpoint(layers=layers, experts=experts, hidden=a.hidden, inter=a.inter, seed=3)
    runs: dict[str, list[tuple[float, float, float]]] = {m: [] for m in MODES}
    rss_of: dict[str, list[dict]] = {m: [] for m in MODES}
    own: list[float] = []                   # the auto runs' predictor CPU, s/fetch
    last: dict[str, dict] = {}
    t_start = time.perf_counter()
    try:
        for rep in range(a.reps):
            for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
                p, m, w, st = replay_once(ckpt, mode, a.slots, a.hit_path, stream)
                runs[mode].append((p, m, w))
                rss_of[mode].append(st)
                last[mode] = st
                if mode == "auto":
                    own.append(st["prediction"]["daemon"]["cpu_s"] / fetches)
                print(f"  rep {rep + 1} {mode:<6} {p * 1e6:7.1f} us CPU/fetch (loop {m * 1e6:6.1f}), "
                      f"{w:.2f}s wall", flush=True)
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    med = harness.median
    print(f"predict_cost: {source}, {fetches} fetches, {layers}x{experts} experts, "
          f"{a.slots} slots, hit path {a.hit_path}; {a.reps} reps alternating auto/client, "
          f"{time.perf_counter() - t_start:.0f}s in all")
    print(f"{'predict':>8} {'daemon us CPU/fetch':>20} {'loop thread us':>15} {'replay wall s':>14}")
    for mode in MODES:
        rs = runs[mode]
        print(f"{mode:>8} {med([r[0] for r in rs]) * 1e6:>20.1f} {med([r[1] for r in rs]) * 1e6:>15.1f} "
              f"{med([r[2] for r in rs]):>14.2f}")
    for mode in MODES:
        print(f"  {mode}: {bought(last[mode])}; RSS {last[mode]['rss'] / 2**20:.0f} MiB")
    rss = [a_["rss"] / c_["rss"] for a_, c_ in zip(rss_of["auto"], rss_of["client"])]
    cpu = [x[0] / y[0] for x, y in zip(runs["auto"], runs["client"])]
    hit = {m: 100 * last[m]["stats"]["hits"] / max(1, last[m]["stats"]["hits"] + last[m]["stats"]["misses"])
           for m in MODES}
    print(f"predict_cost: auto/client daemon CPU per fetch {med(cpu):.2f}x, RSS {med(rss):.2f}x; hit rate "
          f"{hit['auto'] - hit['client']:+.1f} points; skip {last['auto']['prediction']['daemon'].get('skip')} "
          f"(target: <= 1.15x both unless >= +2 points)")
    for i, what in ((0, "daemon"), (1, "loop thread")):
        diff = [(x[i] - y[i]) for x, y in zip(runs["auto"], runs["client"])]
        ratio = [d / y[i] for d, y in zip(diff, runs["client"])]
        print(f"predict_cost: {what} auto - client {med(diff) * 1e6:+.1f} us CPU per fetch, "
              f"{med(ratio):+.2f}x client's per fetch (per-rep {' '.join(f'{r:+.2f}' for r in ratio)})")
    for i, what in ((0, "daemon"), (1, "loop thread")):
        ratio = [o / (r[i] - o) for o, r in zip(own, runs["auto"])]
        print(f"predict_cost: predictor's own CPU {med(own) * 1e6:.1f} us per fetch, {med(ratio):.2f}x the rest of "
              f"the {what}'s per fetch in the same run (per-rep {' '.join(f'{r:.2f}' for r in ratio)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
