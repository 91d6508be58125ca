"""``k3ctl status``: what the daemon is doing.  Exit 0 when it answers, 1 when not.

A short-lived process of its own (the ``k3ctl`` console script): one thread, one
DEALER socket per request; ``render`` is a pure function of the status dict.  It
needs no hello (``status`` is answered to anyone allowed on the socket)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import zmq

from k3client.endpoint import ipc_path, no_access_message, resolve_endpoint, unreachable_dir
from k3client.protocol import PROTOCOL_VERSION, pack, unpack


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


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _pages(a: dict) -> str:
    if a.get("page_bytes", 4096) > 4096:
        return f" in {_mib(a['page_bytes'])} pages"
    if a.get("thp_bytes"):
        return f" ({100 * min(a['thp_bytes'], a['bytes']) / a['bytes']:.0f}% in transparent huge pages)"
    return ""


def render(st: dict) -> str:
    a, s, r = st["arena"], st["stats"], st["readers"]
    total = s["hits"] + s["misses"]
    hit = f"{100 * s['hits'] / total:.1f}%" if total else "-"
    m = st["model"]
    lines = [
        f"k3d {st['version']}  pid {st['pid']}  up {st['uptime_s']:.0f}s  {st['endpoint']}",
        f"model   {m['kind']} {m['path']}: {m['count']} experts, layers {m['layers'][0]}-{m['layers'][-1]}",
        f"arena   {_mib(a['bytes'])}: {a['slots']} slots x {_mib(a['slot_bytes'])}"
        f"{_pages(a)}, "
        f"used {a['used']}, pinned {a['pinned']}, loading {a['loading']}",
        f"cache   hit rate {hit} ({s['hits']} hits, {s['misses']} misses, {s['waited']} waited), "
        f"{s['evictions']} evictions",
        f"predict {s['prefetched']} prefetched, {s['prefetch_hits']} used, {s['prefetch_unused']} unused",
        f"reads   {_mib(s['bytes_read'])} read, {r['busy_bps'] / 1e9:.2f} GB/s per busy reader, "
        f"{r['recent_bps'] / 1e6:.1f} MB/s last 10s, {r['threads']} readers, "
        f"queued {r['queued_urgent']} urgent / {r['queued_background']} background",
        f"errors  {s['errors']} failed reads, {s['bad_requests']} bad requests, {s['cache_full']} cache full, "
        f"{s['clients_dead']} dead clients",
    ]
    tiers = m.get("tiers")
    if tiers:
        o = tiers["origin"]
        lines.append(f"origin  {o['url']}: {o['fetches']} fetches, {_mib(o['bytes'])}, {o['bps'] / 1e6:.0f} MB/s, "
                     f"{o['retries']} retries, {o['errors']} errors")
        d = tiers.get("disk")
        if d:
            lines.append(f"disk    {d['dir']}: {d['hits']} hits, {d['entries']} entries, "
                         f"{_mib(d['bytes'])} of {_mib(d['limit'])}, {d['corrupt']} corrupt")
    lines.append(f"clients {len(st['clients'])}")
    for c in st["clients"]:
        lines.append(f"  {c['name']:<20} pid {c['pid']}  epoch {c['epoch']}  pins {c['pins']}  fetches {c['fetches']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="k3ctl", description="control and inspect the k3d daemon")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("status", help="show the daemon's state")
    p.add_argument("--endpoint")
    p.add_argument("--json", action="store_true", help="machine-readable status")
    p.add_argument("--timeout", type=float, default=2.0)
    args = ap.parse_args(argv)
    if not 0 < args.timeout < 10**6:          # poll(-1) would wait for ever
        ap.error(f"--timeout {args.timeout:g}: use a positive number of seconds")
    endpoint = resolve_endpoint(args.endpoint, os.environ)
    try:
        st = query_status(endpoint, args.timeout)
    except RuntimeError as e:
        print(f"k3ctl: {e}", file=sys.stderr)
        return 1
    print(json.dumps(st, indent=2) if args.json else render(st))
    return 0


if __name__ == "__main__":
    sys.exit(main())
