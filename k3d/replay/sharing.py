"""Sharing, measured: one shared arena of S slots against N private caches of S/N.

``interleave`` makes N clients out of one trace: client i plays the trace's tokens
from token ``i * offset`` on (wrapping round), so at any moment the clients are at
different places in the text (offset in time), with the same model's routing
statistics.  Their fetches are interleaved one request each in turn, each client
keeping its own epochs (``begin`` lines per client).  The shared arena replays the
interleaved trace; each private cache replays its client's own sequence with S/N
slots.  Both go through ``k3d.replay.engine.run`` (the daemon's Store and policies).
"""

from __future__ import annotations

import json
import sys

from k3d.observe.trace import BEGIN, FETCH, PREDICT, Event
from k3d.replay.engine import layers_of, min_slots, run


def tokens_of(events) -> list[list[Event]]:
    """The trace cut into tokens (the events between a client's begin lines); one client."""
    out, cur = [], []
    for ev in events:
        if ev.kind == BEGIN:
            if cur:
                out.append(cur)
            cur = []
        elif ev.kind in (FETCH, PREDICT):
            cur.append(ev)
    if cur:
        out.append(cur)
    return out


def client_events(tokens, client: int, start: int) -> list[Event]:
    n = len(tokens)
    seq: list[Event] = []
    for t in range(n):
        for ev in tokens[(start + t) % n]:
            seq.append(Event(ev.kind, client, ev.keys))
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


def compare(events, n: int, sizes, policies, offset: int | None = None, predictor: str | None = "none") -> dict:
    """{policy: {S: {"shared": hit_rate, "private": hit_rate, "private_slots": S//N}}}.

    ``predictor``: the daemon's own predictor (``engine.run``): the shared arena's one
    learns from every client, each private arena's only from its own; with one,
    ``shared_no_predictor`` is the shared arena without it."""
    shared, per = interleave(events, n, offset)
    layers = layers_of(events)
    floor = min_slots(per[0])
    out: dict = {}
    for name in policies:
        rows = out[name] = {}
        for s in sizes:
            if s // n < floor:
                raise ValueError(f"--slots {s}: a private cache of {s}/{n} slots is below one token's pins "
                                 f"({floor}); use at least {floor * n}")
            sh = run(shared, name, s, layers=layers, predictor=predictor)
            pr = [run(p, name, s // n, layers=layers, predictor=predictor) for p in per]
            hits, total = sum(r.hits for r in pr), sum(r.hits + r.misses for r in pr)
            rows[s] = {"shared": round(sh.hit_rate, 6), "private": round(hits / total, 6),
                       "private_slots": s // n, "shared_bytes_read_ratio": round(sh.misses / max(total - hits, 1), 4)}
            if predictor not in (None, "none") and name != "opt":
                off = run(shared, name, s, layers=layers, predictor="none")
                rows[s]["shared_no_predictor"] = round(off.hit_rate, 6)
                rows[s]["shared_prefetch_unused_share"] = round(sh.prefetch_unused / max(sh.prefetched, 1), 4)
    return out


def main(args, events, names) -> int:
    try:
        sizes = [int(x) for x in args.slots.split(",") if x.strip()]
        predictor = getattr(args, "predictor", "none")
        res = compare(events, args.clients, sizes, names, args.offset,
                      None if predictor == "recorded" else predictor)
    except ValueError as e:
        print(f"k3d replay: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"clients": args.clients, "predictor": getattr(args, "predictor", "none"),
                          "results": {n: {str(s): r for s, r in rs.items()}
                                                              for n, rs in res.items()}}))
        return 0
    print(f"{args.clients} clients, offset in time; one shared arena of S slots vs {args.clients} private of S/N")
    print(f"{'policy':<7} {'S':>5} {'shared':>8} {'private':>8}  {'S/N':>4}  reads shared/private  "
          "shared without the daemon's predictor")
    for n, rs in res.items():
        for s, r in rs.items():
            off = f"{100 * r['shared_no_predictor']:7.1f}%" if "shared_no_predictor" in r else ""
            print(f"{n:<7} {s:>5} {100 * r['shared']:7.1f}% {100 * r['private']:7.1f}%  {r['private_slots']:>4}  "
                  f"{r['shared_bytes_read_ratio']:20.2f}  {off}")
    return 0
