"""Start-up: time to ready with and without the huge-page collapse, and the cold reads each gives.

    python bench/startup.py [--arena 2GiB] [--reps 3] [--batches 24]

Why: by default ``k3d start`` collapses the arena into 2 MiB transparent huge
pages (what is cheap before ready, the rest after; ``--no-thp`` skips that).
The collapse costs start-up time or CPU after it; it buys faster O_DIRECT reads into the arena (a disk request
carries few large memory segments instead of hundreds of 4 KiB ones).  The
default should be the one that makes the arena ready fastest for the same
cold-read speed; this bench measures both sides in one run.

Measured, alternating the two modes rep by rep (drift hits both):
- ready: ``k3d start`` with an arena of ``--arena`` (the daemon's defaults
  otherwise), from the process start to its ``k3d: ready`` line (the arena's
  reservation with its cheap collapse; the rest follows after ready);
- cold reads: a daemon of each mode serving the cold_read bench's packed file
  (gpt-oss-shaped 13.2 MB experts) with ``--read-mode direct``; ``--batches``
  fetches of 4 experts in routing order, the page cache dropped before each;
  GB/s = bytes / fetch time, median.

Printed: medians per mode, the ratios, and which mode the rule picks (the
faster to ready among those within 5 % of the best cold-read speed).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import harness  # noqa: E402
from cold_read import build  # noqa: E402

import k3client  # noqa: E402
from k3d.config import parse_size  # noqa: E402
from k3d.sources.packed import read_header  # noqa: E402

MODES = {"thp": [], "no-thp": ["--no-thp"]}
SAME = 0.05           # cold-read speeds within 5 % count as the same


def time_to_ready(ckpt: str, arena: str, extra: list[str]) -> tuple[float, dict]:
    d = tempfile.mkdtemp(prefix="k3d-b-", dir="/tmp")
    log_path = os.path.join(d, "log")
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        p = subprocess.Popen([sys.executable, "-m", "k3d", "start", "--source", ckpt, "--arena", arena,
                              "--endpoint", f"ipc://{d}/k.sock", "--state-dir", "none", *extra],
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        while True:
            with open(log_path) as f:
                text = f.read()
            if "k3d: ready" in text:
                ready = time.monotonic() - t0
                break
            if p.poll() is not None or time.monotonic() - t0 > 600:
                raise RuntimeError(f"k3d start failed:\n{text}")
            time.sleep(0.01)
    finally:
        p.terminate()
        p.wait(60)
    m = re.search(r"huge pages, reserved in ([\d.]+)s", text)
    return ready, {"arena_s": float(m.group(1))} if m else {}


def cold_gbs(path: str, keys, extra: list[str], batches: int, seed: int) -> float:
    rng = random.Random(seed)
    layers = sorted({layer for layer, _ in keys})
    experts = sorted({e for _, e in keys})
    with harness.Daemon(path, "--read-mode", "direct", "--slots", 4, *extra) as daemon, \
            k3client.connect(daemon.endpoint, name="bench-startup") as c:
        speeds = []
        for _ in range(batches):
            layer = rng.choice(layers)
            batch = rng.sample(experts, 4)
            harness.drop_page_cache(path)
            c.begin_token()
            t0 = time.perf_counter()
            c.fetch(layer, batch)
            speeds.append(4 * c.expert_bytes / (time.perf_counter() - t0) / 1e9)
    return harness.median(speeds)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arena", default="2GiB", help="arena for the time-to-ready runs")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batches", type=int, default=24, help="cold fetches per mode and rep")
    args = ap.parse_args()
    path = build(2, 24)
    h, _ = read_header(path)
    keys = [tuple(k) for k in h["keys"]]
    harness.banner("startup", f"arena {args.arena} ({parse_size(args.arena) / 2**30:.1f} GiB) for time to ready; "
                              f"cold reads from {path}, {args.reps} reps alternating the modes")
    ready = {m: [] for m in MODES}
    cold = {m: [] for m in MODES}
    for rep in range(args.reps):
        for m in (MODES if rep % 2 == 0 else reversed(MODES)):
            r, _ = time_to_ready(path, args.arena, MODES[m])
            ready[m].append(r)
            cold[m].append(cold_gbs(path, keys, MODES[m], args.batches, seed=rep))
            print(f"  rep {rep} {m:<7} ready {r:6.2f} s   cold direct {cold[m][-1]:.2f} GB/s", flush=True)
    med_ready = {m: harness.median(v) for m, v in ready.items()}
    med_cold = {m: harness.median(v) for m, v in cold.items()}
    for m in MODES:
        print(f"startup: {m:<7} ready in {med_ready[m]:.2f} s (median), cold O_DIRECT reads {med_cold[m]:.2f} GB/s")
    best = max(med_cold.values())
    fit = [m for m in MODES if med_cold[m] >= (1 - SAME) * best]
    pick = min(fit, key=lambda m: med_ready[m])
    print(f"startup: thp / no-thp: time to ready {med_ready['thp'] / med_ready['no-thp']:.2f}x, "
          f"cold reads {med_cold['thp'] / med_cold['no-thp']:.2f}x")
    default = "thp"
    print(f"startup: the rule picks {pick} (fastest to ready within {SAME:.0%} of the best cold-read speed); "
          f"the default is {default}: {harness.verdict(pick == default)}")
    return 0 if pick == default else 1


if __name__ == "__main__":
    sys.exit(main())
