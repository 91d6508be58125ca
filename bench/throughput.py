"""Throughput: N model processes decode against one daemon, beside a bare echo server with N clients.

    python bench/throughput.py [--clients 1,2,4,8] [--seconds 8] [--hit-path client|daemon]

Each client process decodes tokens of 16 layers x top-4 of 8 experts (every expert
resident: the arena holds them all, loaded before the clock starts; the routing,
random, drawn before it too): per token one ``begin_token()`` and 16 ``fetch``
calls, for ``--seconds``.  Reported per N:
the aggregate fetches/s of all clients, the median of their p50 fetch latencies,
and the daemon's CPU per fetch (its process CPU time over the run, from psutil),
beside the echo server's CPU per round trip.
Floor, in the same run and with the same N: a bare Python ROUTER echo server in
its own process, each client a DEALER sending a fetch-sized request and waiting for
a fetch-sized reply, as fast as it can; the ratio is daemon fetches/s over echo
round trips/s.  ``--hit-path daemon`` runs the round-trip path for comparison.

Target: at 8 clients, >= 2.5x the echo server's aggregate.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
import psutil  # noqa: E402

LAYERS, EXPERTS, TOP_K = 16, 8, 4
TARGET = 2.5

CLIENT = r"""
import json, random, sys, time
mode, endpoint, seconds, seed = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
rng = random.Random(seed)
lat, n = [], 0
pc = time.perf_counter
if mode == "echo":
    import zmq
    sys.path.insert(0, sys.argv[5])
    from hit_path import fetch_messages
    req = fetch_messages(4)[0]
    ctx = zmq.Context(); s = ctx.socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 0); s.connect(endpoint)
    s.send(req); s.recv()
    print("ready", flush=True); sys.stdin.readline()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(16):
            t0 = pc(); s.send(req); s.recv(); lat.append(pc() - t0); n += 1
    s.close(0); ctx.term()
else:
    import k3client
    with k3client.connect(endpoint, name=f"tp{seed}", hit_path=mode) as c:
        for l in range(%(layers)d):
            c.fetch(l, list(range(%(experts)d)))
        c.begin_token()
        # The routing is drawn before the clock starts: the echo client computes nothing
        # per request, and a model's router is not the cache's cost.
        routes = [rng.sample(range(%(experts)d), %(top_k)d) for _ in range(4096)]
        print("ready", flush=True); sys.stdin.readline()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            c.begin_token()
            for l in range(%(layers)d):
                experts = routes[n & 4095]
                t0 = pc(); c.fetch(l, experts); lat.append(pc() - t0); n += 1
lat.sort()
print(json.dumps({"n": n, "p50": lat[len(lat) // 2] if lat else 0.0}), flush=True)
""" % {"layers": LAYERS, "experts": EXPERTS, "top_k": TOP_K}


def run_clients(mode: str, endpoint: str, n: int, seconds: float) -> tuple[float, float]:
    """(aggregate fetches/s, median of the clients' p50) of ``n`` client processes started together."""
    here = os.path.dirname(os.path.abspath(__file__))
    procs = [subprocess.Popen([sys.executable, "-c", CLIENT, mode, endpoint, str(seconds), str(i), here],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for i in range(n)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    t0 = time.monotonic()
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    out = [json.loads(p.communicate(timeout=seconds + 120)[0].strip().splitlines()[-1]) for p in procs]
    wall = time.monotonic() - t0
    return sum(o["n"] for o in out) / wall, harness.median([o["p50"] for o in out])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--hit-path", choices=("client", "daemon"), default="client")
    a = ap.parse_args()
    counts = [int(x) for x in a.clients.split(",")]
    ckpt = harness.checkpoint(layers=LAYERS, experts=EXPERTS, hidden=256, inter=128, seed=3)
    rows = []
    try:
        with harness.EchoServer(32) as echo, \
                harness.Daemon(ckpt, "--slots", LAYERS * EXPERTS, "--log-level", "warning") as d:
            daemon, echo_p = psutil.Process(d.pid), psutil.Process(echo.pid)
            for n in counts:
                ecpu0 = sum(echo_p.cpu_times()[:2])
                e_rate, e50 = run_clients("echo", echo.endpoint, n, a.seconds)
                e_per = (sum(echo_p.cpu_times()[:2]) - ecpu0) / max(1.0, e_rate * a.seconds)
                cpu0 = sum(daemon.cpu_times()[:2])
                f_rate, f50 = run_clients(a.hit_path, d.endpoint, n, a.seconds)
                cpu = sum(daemon.cpu_times()[:2]) - cpu0
                per_fetch = cpu / max(1.0, f_rate * a.seconds)
                rows.append((n, f_rate, f50, per_fetch, e_rate, e50, e_per))
                harness.banner("throughput", f"{n} clients: {f_rate:,.0f} fetches/s p50 {f50 * 1e6:.0f}us, "
                               f"daemon {per_fetch * 1e6:.1f}us CPU/fetch | echo {e_rate:,.0f}/s "
                               f"p50 {e50 * 1e6:.0f}us | ratio {f_rate / e_rate:.2f}")
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    print(f"throughput: {LAYERS} layers x top-{TOP_K} of {EXPERTS}, all resident, {a.seconds:g}s per run, "
          f"hit path {a.hit_path}")
    print(f"{'clients':>8} {'fetches/s':>11} {'p50 us':>7} {'daemon us CPU/fetch':>20} {'echo/s':>9} "
          f"{'echo p50 us':>11} {'echo us CPU/req':>16} {'ratio':>6}")
    for n, f, f50, cpu, e, e50, ecpu in rows:
        print(f"{n:>8} {f:>11,.0f} {f50 * 1e6:>7.1f} {cpu * 1e6:>20.2f} {e:>9,.0f} {e50 * 1e6:>11.0f} "
              f"{ecpu * 1e6:>16.2f} {f / e:>6.2f}")
    top = rows[-1]
    ok = top[1] / top[4] >= TARGET
    print(f"throughput: at {top[0]} clients {top[1] / top[4]:.2f}x the echo server (target >= {TARGET}) "
          f"{harness.verdict(ok)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
