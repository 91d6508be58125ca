"""Sharing, measured: one shared arena of S slots against N private caches of S/N.

``interleave`` makes N clients out of one trace: client i plays the trace's tokens
from token ``i * offset`` on (wrapping round), so at any moment the clients are at
different places in the text (offset in time), with the same model's routing
statistics.  Their fetches are interleaved one request each in turn, each client
keeping its own epochs (``begin`` lines per client).  The shared arena replays the
interleaved trace; each private cache replays its client's own sequence with S/N
slots.  Both go through ``k3d.replay.engine.run`` (the daemon's Store and policies).

With the daemon's predictor, sharing gains twice: the arena (a key one client read
serves the others) and what was learned (one predictor taught by every client's
stream).  ``--learn both`` tells them apart: the shared arena is replayed again with
one predictor per client (``k3d.cache.predict.private.PerClient``).
"""

from __future__ import annotations

import json
import sys

from k3d.observe.trace import BEGIN, DONE, FETCH, PREDICT, Event
from k3d.replay.engine import layers_of, min_slots, run


def tokens_of(events) -> list[list[Event]]:
    """The trace cut into tokens (the events between a client's begin lines); one client."""
    out, cur = [], []
    for ev in events:
        if ev.kind == BEGIN:
            if cur:
                out.append(cur)
            cur = []
        elif ev.kind in (FETCH, PREDICT, DONE):
            cur.append(ev)
    if cur:
        out.append(cur)
    return out


def client_events(tokens, client: int, start: int) -> list[Event]:
    n = len(tokens)
    seq: list[Event] = []
    for t in range(n):
        for ev in tokens[(start + t) % n]:
            seq.append(Event(ev.kind, client, ev.keys, layers=ev.layers))
        seq.append(Event(BEGIN, client))
    return seq


def interleave(events, n: int, offset: int | None = None) -> tuple[list[Event], list[list[Event]]]:
    """(shared, [private...]): N offset copies, interleaved one request each in turn."""
    tokens = tokens_of(events)
    offset = len(tokens) // n if offset is None else offset
    per = [client_events(tokens, c + 1, c * offset) for c in range(n)]
    shared: list[Event] = []
    for i in range(max(len(p) for p in per)):
        shared.extend(p[i] for p in per if i < len(p))
    return shared, per


LEARN = ("shared", "private", "both")


def compare(events, n: int, sizes, policies, offset: int | None = None, predictor: str | None = "none",
            learn: str = "shared") -> dict:
    """{policy: {S: {"shared": hit_rate, "private": hit_rate, "private_slots": S//N}}}.

    ``predictor``: the daemon's own predictor (``engine.run``).  Each private arena's
    learns from its own client only.  The shared arena's learns from every client
    (``learn`` "shared", the daemon) or one per client (``learn`` "private": what the
    shared arena alone gives); with ``learn`` "both", ``shared`` is the former and
    ``shared_learn_private`` the latter, and the gain splits in two, in hit-rate
    points: ``arena_gain`` (shared arena, private learning, over private arenas) and
    ``learning_gain`` (shared learning over private learning, same arena).  With a
    predictor, ``shared_no_predictor`` is the shared arena without it.  A size whose
    private arenas cannot hold one token's pins is an error, except with a predictor
    and ``learn`` "private" or "both": the private arenas' figures are then None and
    the learning split stands alone (N clients of a small model fill it at S/N)."""
    if learn not in LEARN:
        raise ValueError(f"--learn: one of {', '.join(LEARN)}, not {learn!r}")
    shared, per = interleave(events, n, offset)
    layers = layers_of(events)
    floor = min_slots(per[0])
    predicting = predictor not in (None, "none")
    out: dict = {}
    for name in policies:
        rows = out[name] = {}
        for s in sizes:
            too_small = s // n < floor
            if too_small and (learn == "shared" or not predicting):
                raise ValueError(f"--slots {s}: a private cache of {s}/{n} slots is below one token's pins "
                                 f"({floor}); use at least {floor * n}")
            sh = run(shared, name, s, layers=layers, predictor=predictor,
                     learn="private" if learn == "private" else "shared")
            rows[s] = row = {"shared": round(sh.hit_rate, 6), "private": None, "private_slots": s // n,
                             "shared_bytes_read_ratio": None}
            if not too_small:                  # else (--learn private|both only) the learning split alone
                pr = [run(p, name, s // n, layers=layers, predictor=predictor) for p in per]
                hits, total = sum(r.hits for r in pr), sum(r.hits + r.misses for r in pr)
                row["private"] = round(hits / total, 6)
                row["shared_bytes_read_ratio"] = round(sh.misses / max(total - hits, 1), 4)
            if predicting and name != "opt":
                off = run(shared, name, s, layers=layers, predictor="none")
                row["shared_no_predictor"] = round(off.hit_rate, 6)
                row["shared_prefetch_unused_share"] = round(sh.prefetch_unused / max(sh.prefetched, 1), 4)
                if learn == "both":
                    alone = run(shared, name, s, layers=layers, predictor=predictor, learn="private")
                    row["shared_learn_private"] = round(alone.hit_rate, 6)
                    row["arena_gain"] = None if too_small else round(100 * (alone.hit_rate - row["private"]), 2)
                    row["learning_gain"] = round(100 * (sh.hit_rate - alone.hit_rate), 2)
    return out


def main(args, events, names) -> int:
    learn = getattr(args, "learn", "shared")
    try:
        sizes = [int(x) for x in args.slots.split(",") if x.strip()]
        predictor = getattr(args, "predictor", "none")
        res = compare(events, args.clients, sizes, names, args.offset,
                      None if predictor == "recorded" else predictor, learn)
    except ValueError as e:
        print(f"k3d replay: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"clients": args.clients, "predictor": getattr(args, "predictor", "none"), "learn": learn,
                          "results": {n: {str(s): r for s, r in rs.items()} for n, rs in res.items()}}))
        return 0
    print(f"{args.clients} clients, offset in time; one shared arena of S slots vs {args.clients} private of S/N"
          + ("" if learn == "shared" else f"; the shared arena's predictor learns: {learn}"))
    both = learn == "both"
    print(f"{'policy':<10} {'S':>5} {'shared':>8} {'private':>8}  {'S/N':>4}  reads shared/private  "
          "shared without the daemon's predictor" + ("  shared, learning private  arena gain  learning gain"
                                                      if both else ""))
    for n, rs in res.items():
        for s, r in rs.items():
            off = f"{100 * r['shared_no_predictor']:7.1f}%" if "shared_no_predictor" in r else ""
            split = ""
            if both and "learning_gain" in r:
                arena = "        -" if r["arena_gain"] is None else f"{r['arena_gain']:+9.1f}"
                split = f"{' ' * 30}{100 * r['shared_learn_private']:7.1f}%  {arena}  {r['learning_gain']:+12.1f}"
            private = "       -" if r["private"] is None else f"{100 * r['private']:7.1f}%"
            ratio = "-" if r["shared_bytes_read_ratio"] is None else f"{r['shared_bytes_read_ratio']:.2f}"
            label = "opt-demand" if n == "opt" else n
            print(f"{label:<10} {s:>5} {100 * r['shared']:7.1f}% {private}  {r['private_slots']:>4}  {ratio:>20}  "
                  f"{off}{split}")
    if "opt" in res:
        print("(opt-demand: Belady's OPT under the same pins on demand fetches alone, nothing read ahead: "
              "the daemon's predictor, " + ("off here)" if predictor == "none" else f"{predictor} here, can pass it)"))
    return 0
