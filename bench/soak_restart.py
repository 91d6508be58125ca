"""Soak: 100 ``kill -9`` / restart cycles of a real daemon under running clients.

    python bench/soak_restart.py [--cycles 100] [--clients 2] [--seed N]

Clients (threads of this process, one k3client each, ``reconnect_timeout``
30 s) fetch random experts and compare every byte with
``safetensors.safe_open`` the whole time.  The daemon is killed with SIGKILL
at a random moment (mid-fetch, mid-read, idle) and started again on the same
endpoint.  Checked per cycle: every client is served again within 5 s of the
new daemon's ``ready`` line.  Checked at the end: zero wrong bytes, every
client re-attached once per cycle, /dev/shm unchanged (the arena is a memfd),
no old arena still mapped by the clients, the last daemon exits 0 on SIGTERM.
Exit status 0 when all hold.  The seed is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start(ckpt, endpoint, log_path):
    # The warm-restart state goes beside the endpoint, not into ~/.local/state: a bench
    # leaves nothing in the user's home.
    state = os.path.join(os.path.dirname(endpoint[len("ipc://"):]), "state")
    proc = subprocess.Popen([sys.executable, "-P", "-m", "k3d", "start", "--source", ckpt, "--endpoint", endpoint,
                             "--slots", "48", "--state-dir", state],
                            stdout=open(log_path, "w"), stderr=subprocess.STDOUT, cwd=ROOT)
    t0 = time.monotonic()
    while "k3d: ready" not in open(log_path).read():
        if proc.poll() is not None:
            sys.exit(f"daemon failed:\n{open(log_path).read()}")
        time.sleep(0.01)
    return proc, time.monotonic() - t0


def arena_mappings() -> int:
    with open("/proc/self/maps") as f:
        return len({line.split()[4] for line in f if "k3d-arena" in line})


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=100)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    print(f"seed {seed} (rerun with --seed {seed})", flush=True)
    rng = random.Random(seed)

    import numpy as np
    from safetensors import safe_open

    import k3client
    from k3d.demo.synthetic import write_checkpoint

    ckpt = "/tmp/k3d-soak-ckpt"
    if not os.path.exists(os.path.join(ckpt, "model.safetensors.index.json")):
        write_checkpoint(ckpt, layers=4, experts=16, shards=2, seed=7)
    wm = json.load(open(os.path.join(ckpt, "model.safetensors.index.json")))["weight_map"]
    files = {f: safe_open(os.path.join(ckpt, f), "np") for f in set(wm.values())}
    run = tempfile.mkdtemp(prefix="k3d-soak-", dir="/tmp")
    endpoint = f"ipc://{run}/k.sock"
    log_path = os.path.join(run, "daemon.log")
    shm_before = sorted(os.listdir("/dev/shm"))
    proc, _ = start(ckpt, endpoint, log_path)

    stop = threading.Event()
    state = [{"ok": [], "keys": 0, "wrong": 0, "restarts": 0, "error": None} for _ in range(args.clients)]

    def client(i):
        r, st = random.Random(seed + i), state[i]
        try:
            with k3client.connect(endpoint, name=f"soak{i}", reconnect_timeout=30) as c:
                while not stop.is_set():
                    c.begin_token()
                    layer = r.randrange(4)
                    for ex in c.fetch(layer, r.sample(range(16), 3), predicted=[((layer + 1) % 4, r.randrange(16))]):
                        st["keys"] += 1
                        for spec in c.layout:
                            name = f"model.layers.{ex.layer}.mlp.experts.{ex.expert}.{spec.name}"
                            if not np.array_equal(ex.array(spec.name), files[wm[name]].get_tensor(name)):
                                st["wrong"] += 1
                    st["ok"].append(time.monotonic())
                st["restarts"] = c.restarts
        except BaseException as e:
            st["error"] = repr(e)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    resume, startup = [], []
    for cycle in range(args.cycles):
        time.sleep(rng.uniform(0.02, 0.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc, took = start(ckpt, endpoint, log_path)
        startup.append(took)
        t_ready = time.monotonic()
        for i, st in enumerate(state):
            while not (st["ok"] and st["ok"][-1] > t_ready):
                if st["error"] or time.monotonic() - t_ready > 5:
                    sys.exit(f"cycle {cycle}: client {i} not served within 5 s of the restart ({st['error']})")
                time.sleep(0.005)
        resume.append(max(st["ok"][-1] for st in state) - t_ready)
        if (cycle + 1) % 10 == 0:
            print(f"cycle {cycle + 1}: resume max so far {max(resume):.3f}s", flush=True)
    stop.set()
    for t in threads:
        t.join(60)
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(60)
    keys = sum(s["keys"] for s in state)
    wrong = sum(s["wrong"] for s in state)
    restarts = [s["restarts"] for s in state]
    errors = [s["error"] for s in state if s["error"]]
    shm_same = sorted(os.listdir("/dev/shm")) == shm_before
    mapped = arena_mappings()
    print(f"{args.cycles} kill -9 / restart cycles, {args.clients} clients: {keys} experts verified, {wrong} wrong")
    print(f"daemon start to ready: median {statistics.median(startup):.3f}s max {max(startup):.3f}s")
    print(f"clients served again after ready: median {statistics.median(resume):.3f}s max {max(resume):.3f}s "
          f"(goal < 5 s)")
    print(f"re-attachments per client {restarts} (expected {args.cycles}); /dev/shm unchanged: {shm_same}; "
          f"old arenas still mapped: {mapped}; last daemon exit {rc}")
    ok = (wrong == 0 and not errors and all(r == args.cycles for r in restarts) and shm_same and mapped == 0
          and rc == 0 and max(resume) < 5)
    print("PASS" if ok else f"FAIL {errors}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
