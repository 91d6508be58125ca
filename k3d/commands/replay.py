"""``k3d replay TRACE``: a route trace through the daemon's policies and Belady's OPT.

::

    k3d replay TRACE --slots N[,N...] [--policy P[,P...]] [--json] [--sweep] [--plot FILE.png]
                     [--no-predictions] [--predictor NAME|recorded|none] [--read-lead N]
                     [--clients N --offset TOKENS --learn shared|private|both]

Prints hits, misses, evictions and hit rate per policy and size, OPT (exact, under
the same pins, on demand fetches alone: the bound of a policy that reads nothing
ahead, which the daemon's predictor, on by default, lets the others pass) beside
them.  ``--sweep`` replays every size from the smallest the
trace allows (one token's pins) to the first ``--slots`` value's range end, the
arena sizing curve; ``--plot`` draws it (matplotlib, an optional extra).  ``--json``
prints ``{"default": NAME, "predictor": NAME, "results": {POLICY: {SLOTS: {hits,
misses, evictions, hit_rate, prefetched, prefetch_hits, prefetch_ready,
prefetch_waited, prefetch_unused, auto_prefetched, ...}}}}``.

``--predictor``: the daemon's own predictions (``k3d.cache.predict``).  A name runs
that predictor class as the daemon does (``AutoPrefetch``: after each fetch and its
client's predictions, where the trace's ``auto`` lines say the daemon ran it);
``recorded`` replays the trace's ``auto`` lines as they were (exact even for a daemon
that started warm); ``none`` leaves them out.  Default: as the daemon by default (``Config.predict``:
``auto`` runs its predictor, else none).
``--read-lead N``: the read model for ``prefetch_ready``/``prefetch_waited``: a used
prediction was ready before its request when N or more fetches came between them
(reads complete at once in a replay; hits and misses do not depend on it).

``--clients N`` interleaves N copies of the trace (each offset by
``--offset`` tokens, later ones starting later) and compares one shared arena of S
slots with N private arenas of S/N (``k3d.replay.sharing``); ``--learn`` says
whether the shared arena's predictor learns from every client (``shared``, as the
daemon), from each client apart (``private``), or ``both``, splitting the gain into
the arena's and the shared learning's.

Errors (one line, exit 2), all found before anything is replayed: a malformed trace
line (with its number), a trace without fetches, ``--slots`` below one token's pins
(says the minimum), an unknown policy (lists the known ones), ``--plot`` without
matplotlib or into a directory that is missing or not writable.  A plot written is
named on stderr (stdout stays the table or the JSON).
"""

from __future__ import annotations

import json
import os
import sys

from k3d.cache.policy import POLICIES, UnknownPolicy, make
from k3d.cache.predict import DEFAULT as PREDICT_DEFAULT, PREDICTORS, UnknownPredictor, make as make_predictor
from k3d.config import Config
from k3d.observe.trace import TraceError, read
from k3d.replay import sharing
from k3d.replay.engine import layers_of, min_slots, run


def add_parser(sub):
    p = sub.add_parser("replay", help="replay a route trace through the policies and Belady's OPT")
    p.add_argument("trace", help="route trace file (k3d start --trace FILE)")
    p.add_argument("--slots", required=True,
                   help="arena sizes in slots, comma-separated (with --sweep: LO-HI or a single maximum)")
    p.add_argument("--policy", default=None,
                   help=f"policies, comma-separated (default: all of {', '.join(sorted(POLICIES))}); "
                   "OPT is always added")
    p.add_argument("--json", action="store_true", help="machine-readable results")
    p.add_argument("--sweep", action="store_true", help="every size in the range: the hit-rate-vs-slots curve")
    p.add_argument("--plot", metavar="FILE.png", help="draw the curve to FILE.png (needs matplotlib: the plot extra)")
    p.add_argument("--no-predictions", dest="predictions", action="store_false",
                   help="ignore the trace's predict lines")
    p.add_argument("--predictor", default=PREDICT_DEFAULT if Config.predict == "auto" else "none",
                   help=f"the daemon's own predictor: {', '.join(sorted(PREDICTORS))}, recorded (the trace's "
                   "auto lines as they were) or none (default %(default)s)")
    p.add_argument("--read-lead", dest="read_lead", type=int, default=1,
                   help="a used prediction counts ready if this many fetches came between it and its use, "
                   "else waited (default %(default)s)")
    p.add_argument("--predict-budget", dest="predict_budget", type=int, default=0,
                   help="predictions per fetch, the client's first (0: as many as the fetch has keys)")
    p.add_argument("--clients", type=int, default=1,
                   help="interleave N offset copies: one shared arena of S vs N private ones of S/N")
    p.add_argument("--offset", type=int, default=None, help="tokens between the copies' starts (default: trace/N)")
    p.add_argument("--learn", choices=sharing.LEARN, default="shared",
                   help="with --clients: the shared arena's predictor learns from every client (shared, as the "
                        "daemon), one per client (private), or both, splitting the gain (arena_gain, learning_gain)")
    return p


OPT_ROW = "opt-demand"                      # OPT in the table: demand fetches only
OPT_LABEL = "opt (demand fetches only)"     # and in the plot's legend


def _sizes(text: str, sweep: bool, floor: int) -> list[int]:
    try:
        if sweep and "-" in text:
            lo, hi = (int(x) for x in text.split("-", 1))
            return list(range(max(lo, floor), hi + 1))
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--slots {text!r}: use N, N,N,... or (with --sweep) LO-HI") from None
    if not sizes:
        raise ValueError("--slots: give at least one size")
    if sweep:
        return list(range(floor, max(sizes) + 1))
    return sizes


def main(args) -> int:
    try:
        events = read(args.trace)
        if not any(e.kind == "fetch" for e in events):
            raise ValueError(f"{args.trace}: the trace has no fetches: nothing to replay")
        if args.plot:
            _check_plot(args.plot)
        names = [n.strip() for n in args.policy.split(",")] if args.policy else sorted(POLICIES)
        for n in names:
            if n != "opt":
                make(n)                   # UnknownPolicy lists the known ones
        if args.predictor not in ("recorded", "none"):
            make_predictor(args.predictor)
        names = [n for n in names if n != "opt"] + ["opt"]
        if args.clients > 1:
            return sharing.main(args, events, names)
        floor = min_slots(events)
        sizes = _sizes(args.slots, args.sweep, floor)
        low = [s for s in sizes if s < floor]
        if low:
            raise ValueError(f"--slots {low[0]} is below one token's pins: this trace needs at least {floor} slots")
    except (TraceError, UnknownPolicy, UnknownPredictor, ValueError) as e:
        print(f"k3d replay: error: {e}", file=sys.stderr)
        return 2
    layers = layers_of(events)
    predictor = None if args.predictor == "recorded" else args.predictor
    results = {n: {s: run(events, n, s, predictions=args.predictions, layers=layers, predictor=predictor,
                          read_lead=args.read_lead, budget=args.predict_budget) for s in sizes}
               for n in names}
    if args.json:
        print(json.dumps({"default": Config.policy, "predictor": args.predictor, "trace": args.trace,
                          "accesses": sum(len(e.keys) for e in events if e.kind == "fetch"),
                          "results": {n: {str(s): r.as_dict() for s, r in rs.items()} for n, rs in results.items()}}))
    else:
        print(render(results, Config.policy, curve=args.sweep, predictor=args.predictor))
    if args.plot:
        try:
            plot(results, args.plot, title(args.trace, args.predictor))
        except OSError as e:
            print(f"k3d replay: error: --plot {args.plot}: {e.strerror or e}", file=sys.stderr)
            return 2
        print(f"k3d replay: wrote {args.plot}", file=sys.stderr)
    return 0


def _check_plot(path: str) -> None:
    """Refuse ``--plot PATH`` before the replay when the curve could not be written."""
    try:
        import matplotlib  # noqa: F401  (optional extra: only --plot needs it)
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'k3d-expert-cache[plot]'") from None
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--plot {path}: no directory {folder}")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"--plot {path}: cannot write in {folder}")


def render(results: dict, default: str, curve: bool = False, predictor: str = "none") -> str:
    """Per size and policy: hit rate, hits, misses, evictions (``curve``: hit rates only).

    OPT replays demand fetches alone: it is the bound of a policy that reads nothing
    ahead, and the footer says so, and that a policy with reads ahead (the daemon's
    predictor, by default) can pass it."""
    names = list(results)
    sizes = list(next(iter(results.values())))
    mark = {n: (OPT_ROW if n == "opt" else n) + (" *" if n == default else "") for n in names}
    width = max(9, *map(len, mark.values()))
    if curve:
        lines = ["slots  " + "  ".join(f"{mark[n]:>{max(8, len(mark[n]))}}" for n in names)]
        lines += [f"{s:>5}  " + "  ".join(f"{100 * results[n][s].hit_rate:{max(8, len(mark[n])) - 1}.1f}%"
                                          for n in names) for s in sizes]
    else:
        lines = [f"slots  {'policy':<{width}} {'hit rate':>8} {'hits':>9} {'misses':>9} {'evictions':>9} "
                 f"{'prefetched':>10} {'unused':>7}  vs lru"]
        for s in sizes:
            for n in names:
                r = results[n][s]
                vs = ""
                if "lru" in results and n != "lru":
                    vs = f"{100 * (r.hit_rate - results['lru'][s].hit_rate):+6.1f}"
                lines.append(f"{s:>5}  {mark[n]:<{width}} {100 * r.hit_rate:7.1f}% {r.hits:>9} {r.misses:>9} "
                             f"{r.evictions:>9} {r.prefetched:>10} {r.prefetch_unused:>7}  {vs}")
    ahead = any(r.prefetched for n, rs in results.items() if n != "opt" for r in rs.values())
    lines.append(f"(* the default policy; the daemon's own predictor: {predictor}"
                 + (")" if curve else "; prefetched: experts read ahead, by it or by the trace's predictions)"))
    lines.append(f"({OPT_ROW}: Belady's OPT under the same pins on demand fetches alone, nothing read ahead: "
                 + ("the bound of a policy that reads nothing ahead; reads ahead can pass it)" if ahead
                    else "the bound, as nothing was read ahead here)"))
    return "\n".join(lines)


def title(trace: str, predictor: str) -> str:
    """The plot's title: the trace's file name (not the folder it was in on this machine)."""
    return f"k3d replay {os.path.basename(trace)}, predictor {predictor}"




def plot(results: dict, path: str, title: str) -> None:
    """The hit-rate curve per policy into the PNG ``path``, with ``title`` drawn and in its metadata."""
    import matplotlib  # optional extra: only --plot needs it
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n, rs in results.items():
        ax.plot(list(rs), [100 * r.hit_rate for r in rs.values()], label=OPT_LABEL if n == "opt" else n,
                linestyle="--" if n == "opt" else "-")
    ax.set_xlabel("arena slots")
    ax.set_ylabel("hit rate %")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120, metadata={"Title": title})
