"""Sharing: 4 client processes read every byte of every resident expert; sum of their PSS.

    python bench/sharing.py [--clients 4] [--experts 32]

Checkpoint: gpt-oss-shaped MXFP4 experts (hidden 2880, inter 2880, 13.2 MB
each), 2 layers x experts/2, arena of exactly that many slots (~420 MB), all
loaded once before the clients start.  Each client process connects, fetches
every expert (all hits, all pinned in its epoch) and reduces every tensor of
every expert through its zero-copy ``Expert.array`` view (a sum and an xor, so
every page is read), then reports its checksums and waits.  While all clients
hold their views, this process reads each one's PSS, USS and RSS from
``/proc/PID/smaps_rollup`` (psutil ``memory_full_info``).  The daemon maps the
arena too, so each shared page is split over clients + 1 processes.

Target: sum of the clients' PSS <= arena + clients x 150 MiB
(each process reads the arena, none holds a copy).  Repeated ``--reps`` times
with fresh client processes; the median sum is reported.
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

HIDDEN = INTER = 2880
PER_CLIENT = 150 * 2**20
MiB = 2**20


def worker(endpoint: str, layers: int, experts: int) -> int:
    """One model process: fetch everything, read every byte through views, report, wait."""
    import numpy as np

    import k3client

    with k3client.connect(endpoint, name=f"bench-share-{os.getpid()}") as c:
        c.begin_token()
        total, xor, nbytes = 0, 0, 0
        t0 = time.perf_counter()
        for layer in range(layers):
            for ex in c.fetch(layer, range(experts)):
                for spec in c.layout:
                    a = ex.array(spec.name).reshape(-1)
                    total += int(a.sum(dtype=np.uint64))
                    xor ^= int(np.bitwise_xor.reduce(a.view(np.uint64) if a.nbytes % 8 == 0 else a))
                    nbytes += a.nbytes
        secs = time.perf_counter() - t0
        print(json.dumps({"pid": os.getpid(), "sum": total, "xor": xor, "bytes": nbytes, "seconds": secs}),
              flush=True)
        sys.stdin.readline()          # hold the views until the parent has measured
    return 0


def mem(pid: int) -> dict:
    import psutil

    m = psutil.Process(pid).memory_full_info()
    return {"pss": m.pss, "uss": m.uss, "rss": m.rss}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32, help="experts in all (2 layers)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--worker", nargs=3, metavar=("ENDPOINT", "LAYERS", "EXPERTS"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker[0], int(a.worker[1]), int(a.worker[2]))

    import k3client

    layers, per_layer = 2, max(1, a.experts // 2)
    n = layers * per_layer
    ckpt = harness.checkpoint(layers=layers, experts=per_layer, hidden=HIDDEN, inter=INTER, seed=3)
    sums, results = [], []
    try:
        with harness.Daemon(ckpt, "--slots", n) as d:
            with k3client.connect(d.endpoint, name="bench-share-loader") as c:
                for layer in range(layers):          # load everything once; nothing is evicted later
                    c.fetch(layer, range(per_layer))
                arena = c.slots * c.slot_bytes
                expert_bytes = c.expert_bytes
            for r in range(a.reps):
                procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", d.endpoint,
                                           str(layers), str(per_layer)],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                         for _ in range(a.clients)]
                try:
                    reports = [json.loads(p.stdout.readline()) for p in procs]
                    mems = [mem(p.pid) for p in procs]
                    dmem = mem(d.pid)
                    st = k3client.connect(d.endpoint, name="bench-share-status")
                    status = st.status()
                    st.close()
                finally:
                    for p in procs:
                        try:
                            p.stdin.write("\n")
                            p.stdin.close()
                        except OSError:
                            pass
                    rcs = [p.wait(30) for p in procs]
                assert rcs == [0] * a.clients, f"client exit codes {rcs}"
                assert len({(x["sum"], x["xor"], x["bytes"]) for x in reports}) == 1, "clients read different bytes"
                assert reports[0]["bytes"] == n * expert_bytes
                assert status["stats"]["misses"] == n, f"{status['stats']['misses']} misses, expected {n} (loader only)"
                total = sum(m["pss"] for m in mems)
                sums.append(total)
                results.append((mems, dmem, reports))
                harness.banner("sharing", f"rep {r + 1}/{a.reps}: PSS " +
                               " ".join(f"{m['pss'] / MiB:.0f}" for m in mems) +
                               f" MiB (sum {total / MiB:.0f} MiB); USS " +
                               " ".join(f"{m['uss'] / MiB:.0f}" for m in mems) +
                               f" MiB; RSS {mems[0]['rss'] / MiB:.0f} MiB each; "
                               f"daemon PSS {dmem['pss'] / MiB:.0f} MiB; "
                               f"each client read {reports[0]['bytes'] / MiB:.0f} MiB in "
                               f"{harness.median([x['seconds'] for x in reports]):.2f}s")
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)

    total = harness.median(sums)
    mems, dmem, _ = results[sorted(range(len(sums)), key=sums.__getitem__)[len(sums) // 2]]
    limit = arena + a.clients * PER_CLIENT
    print(f"sharing: {a.clients} clients, {n} resident experts of {expert_bytes / 1e6:.1f} MB, "
          f"arena {arena / MiB:.0f} MiB; every byte read through views by every client; median of {a.reps} reps")
    print("sharing: pss " + " ".join(f"{m['pss'] / MiB:.0f}" for m in mems) +
          f" MiB sum {total / MiB:.0f} MiB limit {limit / MiB:.0f} MiB (arena {arena / MiB:.0f} + "
          f"{a.clients} x 150) daemon_pss {dmem['pss'] / MiB:.0f} MiB ratio {total / limit:.2f} (target <= 1.0) "
          f"{harness.verdict(total <= limit)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
