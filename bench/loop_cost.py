"""The server loop's own cost: daemon CPU per request that still goes through it, beside a bare echo.

    python bench/loop_cost.py [--reps 5] [--block 2000]

With hits answered in the clients, what reaches the daemon's loop is token
boundaries, misses and predictions.  This measures the loop's CPU for one
request of each kind that needs no read, so that nothing but the loop is timed:

- ``token``: ``begin_token()`` with nothing to report (every token sends one);
- ``fetch``: a fetch of 4 resident experts over the round-trip path
  (``hit_path="daemon"``): the whole request path of a fetch, planning and
  pinning included, without a read;
- ``report``: per token, 16 fetches of 4 experts answered in the client and
  reported with the next ``begin_token()``; the figure is per reported fetch (the
  policy hearing each access, which a hit still costs the daemon).

Floor, in the same run: a bare Python ROUTER echo server (``hit_path.py``'s) in
its own process, a DEALER sending a fetch-sized request and waiting for a
fetch-sized reply.  Blocks of ``--block`` requests of each kind alternate with
blocks of echo round trips, so the VM's drifting speed hits both alike.  CPU is
each server process's run time over the block (the scheduler's, per thread), so ZeroMQ's I/O
thread counts on both sides; the loop thread's own share is shown too.  Figures
are medians over ``--reps``; the ratio is the median of per-rep ratios.

Target: ``token`` and ``fetch`` at most 2x the echo's CPU per request.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
import psutil  # noqa: E402
import zmq  # noqa: E402
from hit_path import fetch_messages  # noqa: E402

import k3client  # noqa: E402

LAYERS, EXPERTS, TOP_K = 16, 8, 4
TARGET = 2.0


def cpu(proc: psutil.Process) -> tuple[float, float]:
    """(process CPU seconds, main thread's CPU seconds) of a server process, from the
    scheduler's nanosecond run times (``/proc/PID/task/TID/schedstat``): psutil's
    clock ticks (10 ms) are too coarse for blocks of a few tens of milliseconds."""
    total = main = 0.0
    for tid in os.listdir(f"/proc/{proc.pid}/task"):
        try:
            with open(f"/proc/{proc.pid}/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue
        total += ns / 1e9
        if int(tid) == proc.pid:
            main = ns / 1e9
    return total, main


def measured(proc: psutil.Process, run, n: int) -> tuple[float, float]:
    """(process, main thread) CPU seconds per request of ``run()``, which makes ``n`` requests."""
    p0, m0 = cpu(proc)
    run()
    p1, m1 = cpu(proc)
    return (p1 - p0) / n, (m1 - m0) / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--block", type=int, default=2000, help="requests per timed block")
    a = ap.parse_args()
    print(f"[loop_cost] k3d {harness.build()}", flush=True)
    rng = random.Random(7)
    ckpt = harness.checkpoint(layers=LAYERS, experts=EXPERTS, hidden=256, inter=128, seed=3)
    req, rep = fetch_messages(TOP_K)
    rows: dict[str, list[tuple[float, float, float]]] = {"token": [], "fetch": [], "report": []}
    try:
        with harness.EchoServer(len(rep)) as echo, \
                harness.Daemon(ckpt, "--slots", LAYERS * EXPERTS, "--log-level", "warning") as d, \
                k3client.connect(d.endpoint, name="rt", hit_path="daemon") as rt, \
                k3client.connect(d.endpoint, name="local", hit_path="client") as local:
            ctx = zmq.Context()
            es = ctx.socket(zmq.DEALER)
            es.setsockopt(zmq.LINGER, 0)
            es.connect(echo.endpoint)
            echo_p, daemon = psutil.Process(echo.pid), psutil.Process(d.pid)

            def echo_block():
                for _ in range(a.block):
                    es.send(req)
                    es.recv()

            for layer in range(LAYERS):                 # everything resident before the clock starts
                rt.fetch(layer, list(range(EXPERTS)))
            rt.begin_token()
            draws = [rng.sample(range(EXPERTS), TOP_K) for _ in range(LAYERS * 64)]

            def token_block():
                for _ in range(a.block):
                    rt.begin_token()

            def fetch_block():
                for i in range(a.block):
                    if i % LAYERS == 0:
                        rt.begin_token()
                    rt.fetch(i % LAYERS, draws[i % len(draws)])

            def report_block():                         # a.block reported fetches
                for i in range(a.block):
                    local.fetch(i % LAYERS, draws[i % len(draws)])
                    if i % LAYERS == LAYERS - 1:
                        local.begin_token()
                local.begin_token()

            for block in (token_block, fetch_block, report_block, echo_block):
                block()                                 # warm every path
            for _ in range(a.reps):
                for kind, block in (("token", token_block), ("fetch", fetch_block), ("report", report_block)):
                    e_proc, _ = measured(echo_p, echo_block, a.block)
                    n = a.block + (a.block // LAYERS if kind == "fetch" else 0)
                    d_proc, d_main = measured(daemon, block, n)
                    rows[kind].append((d_proc, d_main, e_proc))
            hp = rt.status()["stats"]
            es.close(0)
            ctx.term()
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    print(f"loop_cost: {a.reps} reps of {a.block} requests per kind, alternating with the echo; "
          f"{hp['client_hits']} hits answered in the client, {hp['misses']} misses")
    print(f"{'kind':>7} {'daemon us CPU/req':>18} {'loop thread us':>15} {'echo us CPU/req':>16} {'ratio':>6}")
    ok = True
    for kind, rs in rows.items():
        ratio = harness.median([p / e for p, _, e in rs])
        print(f"{kind:>7} {harness.median([r[0] for r in rs]) * 1e6:>18.1f} "
              f"{harness.median([r[1] for r in rs]) * 1e6:>15.1f} {harness.median([r[2] for r in rs]) * 1e6:>16.1f} "
              f"{ratio:>6.2f}  (per-rep {' '.join(f'{p / e:.2f}' for p, _, e in rs)})")
        if kind != "report":
            ok = ok and ratio <= TARGET
    print(f"loop_cost: token and fetch at most {TARGET}x the echo's CPU per request {harness.verdict(ok)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
