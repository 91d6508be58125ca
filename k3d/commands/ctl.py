"""``k3ctl status``: what the daemon is doing; ``k3ctl verify MODEL_DIR``: whether it serves
exactly that checkpoint (``k3d.commands.verify``).

Exit status: 0 when it serves, 3 while it is starting (it answers status from
the moment it holds its endpoint, with the phase, progress and ETA), 1 when it
does not answer (with ``--json`` the failure is JSON on stdout too).
``--watch [SECONDS]`` redraws the view every SECONDS (default 2) in place on a
terminal, adding hit rate and throughput over the last interval and since
start; elsewhere (a pipe, a log) it prints one frame per interval, and with
``--json`` one JSON object per line.  Ctrl-C ends it with exit 0.

A short-lived process of its own (the ``k3ctl`` console script), one thread;
``status`` needs no hello.  Its imports are kept to the standard library, zmq,
msgpack and ``k3client.endpoint``/``protocol`` (``k3client`` loads its client and
numpy lazily), so that ``k3ctl status`` costs little beyond Python's own start (zmq
is most of what it adds).  What only some runs need is loaded where it is used:
the start-up's progress line (``k3d.service.starting``) and ``verify``.  Client
names are escaped by ``k3d.serve.names``, the daemon's rule without its access
checks (logging, sockets).  tests/unit/test_ctl_imports.py keeps that so.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from types import SimpleNamespace

import zmq

from k3client.endpoint import (
    ipc_path,
    no_access_message,
    resolve_endpoint,
    unreachable_dir,
)
from k3client.protocol import PROTOCOL_VERSION, pack, unpack
from k3d.serve.names import printable
from k3d.sizes import show_size


def query_status(endpoint: str, timeout: float) -> dict:
    """One status request without attaching (no hello, no arena)."""
    path = ipc_path(endpoint)
    if path is not None and not os.path.exists(path):
        blocked = unreachable_dir(path)
        if blocked:
            raise RuntimeError(no_access_message(path, blocked))
        raise RuntimeError(f"k3d is not running at {endpoint} (no socket {path})")
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        try:
            s.connect(endpoint)
        except zmq.ZMQError as e:
            raise RuntimeError(f"cannot connect to {endpoint}: {e.strerror} "
                               "(use ipc:///path/k3d.sock or tcp://host:port)") from None
        s.send(pack({"v": PROTOCOL_VERSION, "op": "status", "id": 1}))
        if not s.poll(int(timeout * 1000)):
            raise RuntimeError(f"k3d is not running at {endpoint} (no answer in {timeout:g}s)")
        reply = unpack(s.recv())
    finally:
        s.close(0)
        ctx.term()
    if not reply.get("ok"):
        raise RuntimeError(f"k3d at {endpoint} refused status: {reply.get('error', {}).get('message')}")
    return reply["status"]


def prediction_line(q: dict) -> str:
    """Prediction quality in one line (``k3d.observe.quality``'s figures)."""
    prec = q.get("precision")
    p = "-" if prec is None else f"{100 * prec:.1f}%"
    return (f"precision {p} ({q['prefetch_hits']}/{q['prefetched']}), fetched keys ready {q['ready']} / "
            f"waited {q['waited']} / missed {q['missed']}, {q['unused_bytes'] / 2**20:.1f} MiB unused")


def _pages(a: dict) -> str:
    if a.get("page_bytes", 4096) > 4096:
        return f" in {show_size(a['page_bytes'])} pages"
    if a.get("thp_bytes"):
        return f" ({100 * min(a['thp_bytes'], a['bytes']) / a['bytes']:.0f}% in transparent huge pages)"
    return ""


def _preparing(a: dict) -> str:
    """While the arena's collapse and pre-fault still run after ready (``k3d.memory.prepare``)."""
    p = a.get("prepare") or {}
    if p.get("state") != "running" or not p.get("total"):
        return ""
    return f", preparing in the background ({100 * p['done'] // p['total']} % pre-faulted)"


EXIT_OK, EXIT_DOWN, EXIT_STARTING = 0, 1, 3


def render_starting(st: dict) -> str:
    """``starting: reserving the arena 1.2/4.0 GiB (30 %), ~8 s left``."""
    from k3d.service.starting import describe  # the daemon's start-up: only while it is starting
    return f"starting: {describe(st)}"


def render_rates(prev: dict | None, st: dict, dt: float) -> str:
    """Hit rate and read throughput over the last interval and since start."""
    s = st["stats"]
    total = s["hits"] + s["misses"]
    since = f"{100 * s['hits'] / total:.1f}%" if total else "-"
    up = max(st["uptime_s"], 1e-9)
    line = f"since start: hit rate {since}, {s['bytes_read'] / up / 1e6:.1f} MB/s read"
    if prev is not None and prev.get("state") != "starting" and dt > 0:
        p = prev["stats"]
        dh, dm = s["hits"] - p["hits"], s["misses"] - p["misses"]
        rate = f"{100 * dh / (dh + dm):.1f}%" if dh + dm else "-"
        line = (f"last {dt:.1f}s: hit rate {rate}, {(dh + dm) / dt:.0f} keys/s, "
                f"{(s['bytes_read'] - p['bytes_read']) / dt / 1e6:.1f} MB/s read   " + line)
    return line


def _layers(layers: list) -> str:
    """The layers served: ``0-47`` when contiguous, else each one (Jamba: ``1,3,5,7``)."""
    if layers and layers == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}"
    return ",".join(str(x) for x in layers) or "none"


def _digest(d) -> str:
    """The content digest line (``k3d.sources.digest``): prefix, rule, what it cost."""
    if not isinstance(d, dict):
        return "-"
    if d.get("pending"):
        return f"computing after ready: {d.get('done', 0)} of {d.get('total', '?')} experts"
    if "hex" not in d:
        return f"none: {d.get('error', '?')}"
    how = "from the state directory" if d.get("cached") else \
        f"{show_size(d.get('bytes_read', 0))} read in {d.get('seconds', 0):.2f}s"
    return f"{d['hex'][:16]} ({d.get('rule')}, {len(d.get('parts') or [])} tensor groups; {how})"


def _build(st: dict) -> str:
    """`` [compiled (16 modules, mypyc)]``; nothing from a daemon older than the field."""
    return f" [{st['build']}]" if st.get("build") else ""


def render(st: dict) -> str:
    if st.get("state") == "starting":
        return render_starting(st)
    a, s, r = st["arena"], st["stats"], st["readers"]
    total = s["hits"] + s["misses"]
    hit = f"{100 * s['hits'] / total:.1f}%" if total else "-"
    m = st["model"]
    lines = [
        f"k3d {st['version']}{_build(st)}  pid {st['pid']}  up {st['uptime_s']:.0f}s  {st['endpoint']}",
        f"model   {m['kind']} {m['path']}:{' ' + m['family'] if m.get('family') else ''} {m['count']} experts, "
        f"layers {_layers(m['layers'])}",
        f"digest  {_digest(m.get('digest'))}",
        f"arena   {show_size(a['bytes'])}: {a['slots']} slots x {show_size(a['slot_bytes'])}"
        f"{_pages(a)}{_preparing(a)}, "
        f"used {a['used']}, pinned {a['pinned']}, loading {a['loading']}",
        f"cache   hit rate {hit} ({s['hits']} hits, {s['misses']} misses, {s['waited']} waited), "
        f"{s['evictions']} evictions",
        f"predict {s['prefetched']} prefetched, {s['prefetch_hits']} used, {s['prefetch_unused']} unused",
        f"reads   {show_size(s['bytes_read'])} read, {r['busy_bps'] / 1e9:.2f} GB/s per busy reader, "
        f"{r['recent_bps'] / 1e6:.1f} MB/s last 10s, {r['threads']} readers, "
        f"queued {r['queued_urgent']} urgent / {r['queued_background']} background",
        f"errors  {s['errors']} failed reads, {s['bad_requests']} bad requests, {s['cache_full']} cache full, "
        f"{s['clients_dead']} dead clients, {s.get('replies_dropped', 0)} replies dropped",
    ]
    pq = st.get("prediction")
    if pq:      # prediction quality, in total and per client (k3d.observe.quality)
        lines.append(f"        {prediction_line(pq['total'])}")
        a = pq.get("daemon")
        if a:   # the daemon's own predictor (--predict auto)
            lines.append(f"auto    {a['predictor']}: {a['issued']} read ahead, used {a['used_in_time']} in time / "
                         f"{a['used_late']} late, {a['unused']} unused ({a['unused_bytes'] / 2**20:.1f} MiB), "
                         f"{a['refused']} refused; {1e6 * a['cpu_s'] / max(1, a['fetches']):.0f} us CPU per fetch")
    w = st.get("warm") or {}
    if "planned" in w:
        lines.append(f"warm    {st.get('policy', '')} statistics from {w['state_file']}: pre-loaded {w['ready']} of "
                     f"{w['planned']} hot experts ({w['percent']:.0f}%{', done' if w['done'] else ''})")
    for changed in st.get("source_changed") or ():
        lines.append(f"CHANGED {changed}")
    tiers = m.get("tiers")
    if tiers:
        o = tiers["origin"]
        state = "" if o.get("up", True) else f"DOWN for {o['down_s']:.0f}s ({o['error']}), serving from disk; "
        lines.append(f"origin  {o['url']}: {state}{o['fetches']} fetches, {show_size(o['bytes'])}, "
                     f"{o['bps'] / 1e6:.0f} MB/s, {o['retries']} retries, {o['errors']} errors")
        d = tiers.get("disk")
        if d:
            lines.append(f"disk    {d['dir']}: {d['hits']} hits, {d['entries']} entries, "
                         f"{show_size(d['bytes'])} of {show_size(d['limit'])}, {d['corrupt']} corrupt")
    paced = (f" ({s['paced']} holds of clients over their CPU share, {s['paced_seconds']:.1f}s)"
             if s.get("paced") else "")
    lines.append(f"clients {len(st['clients'])}{paced}")
    for c in st["clients"]:
        lines.append(f"  {printable(str(c['name'])):<20} pid {c['pid']}  epoch {c['epoch']}  pins {c['pins']}  "
                     f"fetches {c['fetches']}{_cpu(c)}{_over_cap(c)}")
        q = (pq or {}).get("clients", {}).get(str(c.get("id")))
        if q:
            lines.append(f"    predict {prediction_line(q)}")
    return "\n".join(lines)


def _cpu(c: dict) -> str:
    """A client's share of the daemon's recent CPU, and its holds when it went far over it."""
    if "cpu_share" not in c:        # a daemon older than pacing
        return ""
    held = f", held back {c['paced']}x for {c['paced_s']:.1f}s" if c.get("paced") else ""
    return f"  cpu {100 * c['cpu_share']:.0f}%{held}"


def _over_cap(c: dict) -> str:
    """The requests a client sent with the most already waiting (k3d/serve/intake.py)."""
    n = c.get("over_cap")
    return f"  {n} requests refused: too many waiting ({c.get('queued', 0)} now)" if n else ""


def _failure(args, endpoint: str, message: str) -> None:
    if args.json:
        print(json.dumps({"ok": False, "endpoint": endpoint, "error": message}), flush=True)
    else:
        print(f"k3ctl: {message}", file=sys.stderr, flush=True)


def _once(args, endpoint: str) -> int:
    try:
        st = query_status(endpoint, args.timeout)
    except RuntimeError as e:
        _failure(args, endpoint, str(e))
        return EXIT_DOWN
    print(json.dumps(st, indent=2) if args.json else render(st))
    return EXIT_STARTING if st.get("state") == "starting" else EXIT_OK


def _watch(args, endpoint: str) -> int:
    tty = sys.stdout.isatty() and not args.json
    prev, t_prev = None, 0.0
    try:
        while True:
            t = time.monotonic()
            try:
                st = query_status(endpoint, args.timeout)
            except RuntimeError as e:
                st, frame = None, f"k3ctl: {e}"
                if args.json:
                    frame = json.dumps({"ok": False, "endpoint": endpoint, "error": str(e)})
            else:
                if args.json:
                    frame = json.dumps(st)
                else:
                    frame = render(st)
                    if st.get("state") != "starting":
                        frame += "\n" + render_rates(prev, st, t - t_prev)
            if tty:   # home, clear to the end: the view redraws in place
                sys.stdout.write("\x1b[H\x1b[J" + time.strftime("%H:%M:%S") +
                                 f"  every {args.watch:g}s (Ctrl-C to stop)\n" + frame + "\n")
            else:
                sys.stdout.write(frame + ("\n" if args.json else "\n\n"))
            sys.stdout.flush()
            prev, t_prev = st, t
            time.sleep(max(0.0, args.watch - (time.monotonic() - t)))
    except KeyboardInterrupt:
        return EXIT_OK


STATUS_TIMEOUT = 2.0        # seconds ``status`` waits for an answer unless --timeout says


def plain_status(argv: list[str]) -> SimpleNamespace | None:
    """The arguments of ``status [--json] [--endpoint ENDPOINT]`` (each option at most once,
    in any order), as argparse would give them; None for anything else, which argparse
    parses (every other option and form, help, usage and errors).  The common command
    so skips argparse and the gettext and locale it loads, ~3 ms of a ~45 ms process."""
    if argv[:1] != ["status"]:
        return None
    args = SimpleNamespace(cmd="status", endpoint=None, json=False, watch=None, timeout=STATUS_TIMEOUT)
    rest = argv[1:]
    while rest:
        arg, rest = rest[0], rest[1:]
        if arg == "--json" and not args.json:
            args.json = True
        elif arg.startswith("--endpoint=") and args.endpoint is None and len(arg) > len("--endpoint="):
            args.endpoint = arg[len("--endpoint="):]
        elif arg == "--endpoint" and args.endpoint is None and rest and rest[0] and rest[0][0] != "-":
            args.endpoint, rest = rest[0], rest[1:]
        else:
            return None
    return args


def main(argv=None) -> int:
    args = plain_status(sys.argv[1:] if argv is None else list(argv))
    code = _main(argv) if args is None else _once(args, resolve_endpoint(args.endpoint, os.environ))
    if argv is None:
        # The process ends now (the console script): its objects need no final garbage
        # collections, which cost ~4 ms here (zmq's objects, most of them).  Sockets and
        # context are already closed, and stdout is still flushed at exit.
        gc.freeze()
    return code


def parser():
    """k3ctl's argparse parsers: (the top level, its subcommands, ``status``, ``verify``)."""
    import argparse  # (lazily: see plain_status)

    ap = argparse.ArgumentParser(prog="k3ctl", description="control and inspect the k3d daemon")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("status", help="show the daemon's state",
                       description="exit 0: serving; 3: starting (phase, progress, ETA); 1: not answering")
    p.add_argument("--endpoint", help="default: K3D_ENDPOINT, else the per-user default socket")
    p.add_argument("--json", action="store_true", help="machine-readable status (a failure is JSON too)")
    p.add_argument("--watch", nargs="?", type=float, const=2.0, metavar="SECONDS",
                   help="refresh every SECONDS (default 2) with rates over the last interval")
    p.add_argument("--timeout", type=float, default=STATUS_TIMEOUT,
                   help=f"seconds to wait for an answer (default {STATUS_TIMEOUT:g})")
    v = sub.add_parser("verify", help="check that the daemon serves exactly MODEL_DIR (bytes, then logits)",
                       description="exit 0: verified; 1: a mismatch (the first layer and expert that "
                       "differ are named); 2: cannot verify (no daemon, an unreadable MODEL_DIR)")
    v.add_argument("model_dir", metavar="MODEL_DIR", help="the checkpoint the daemon should serve")
    v.add_argument("--endpoint", help="default: K3D_ENDPOINT, else the per-user default socket")
    v.add_argument("--tokens", type=int, default=8, help="tokens run through the model twice (default 8)")
    v.add_argument("--tolerance", type=float, default=0.0,
                   help="largest logit difference accepted (default 0: bit-equal)")
    v.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the daemon (default 30)")
    return ap, sub, p, v


def _main(argv) -> int:
    """Every command line that ``plain_status`` leaves, through argparse."""
    ap, sub, p, v = parser()
    args = parse_args(ap, sub, argv)
    if args.cmd == "verify":
        if not 1 <= args.tokens <= 4096:
            v.error(f"--tokens {args.tokens}: use 1 to 4096")
        if not args.tolerance >= 0:
            v.error(f"--tolerance {args.tolerance:g}: use 0 or more")
        from k3d.commands.verify import run  # lazily: status needs none of it
        return run(args.model_dir, resolve_endpoint(args.endpoint, os.environ), args.tokens, args.tolerance,
                   timeout=args.timeout)
    if not 0 < args.timeout < 10**6:          # poll(-1) would wait for ever
        p.error(f"--timeout {args.timeout:g}: use a positive number of seconds")
    if args.watch is not None and not 0.1 <= args.watch < 10**6:
        p.error(f"--watch {args.watch:g}: use at least 0.1 seconds")
    endpoint = resolve_endpoint(args.endpoint, os.environ)
    if args.watch is not None:
        return _watch(args, endpoint)
    return _once(args, endpoint)


def parse_args(ap, sub, argv):
    """``ap.parse_args``, but a misspelled option shows the subcommand's usage, not the top
    level's (``k3d`` uses it too)."""
    args, extra = ap.parse_known_args(argv)
    if extra:
        sub.choices[args.cmd].error(f"unrecognized arguments: {' '.join(extra)}")
    return args


if __name__ == "__main__":
    sys.exit(main())
