"""Load test: 16 model processes, skewed routing, predictions, random deaths, one abuser.

    python bench/load.py [--seconds 60] [--clients 16] [--seed N] [--flood]

One real ``k3d start`` on a synthetic checkpoint (8 layers x 64 experts,
~108 MB; arena 384 slots: the cache cannot hold everything).  Each
well-behaved client runs tokens: for every layer it fetches 4 experts drawn
from a Zipf distribution (the same popular experts for every client, as
routers are), predicts the next layer, "computes" for ``--think-ms``, and
compares every fetched expert byte for byte with ``safetensors.safe_open``.
Every ``--death-every`` seconds one client is killed with SIGKILL (wherever
it is, mid-fetch included) and replaced.

The run is cut into segments alternating without / with one abusive client
(which pins its whole quota every token with uniformly random, mostly cold
experts and floods predictions); alternating cancels drift.  The abuser is
one process for the whole run, attached and idle (no pins, no requests)
outside its segments, so no process start-up is measured as abuse;
``--control`` keeps it idle throughout, and the ratio printed then is the
measurement's own noise floor.  ``--flood``: the abusive client is a flooder
instead, a raw DEALER that says hello and then, in its segments, sends fetches
of popular experts as fast as ZeroMQ takes them and never reads a reply
(bounded intake: ``k3d/serve/intake.py``); it heartbeats on a second socket, as
``k3client`` does, so it stays attached.  Reported:
p50/p99 fetch latency of the well-behaved clients in both conditions and
the ratio of p99s (goal <= 1.25), wrong bytes (goal 0), leaked pins after
every client exits (goal 0), and the daemon's RSS in the first vs the last
window (a minute, or 10 s for runs under 2 minutes; goal <= 5 % growth).
Exit status 0 when every goal holds.  The seed is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

LAYERS, EXPERTS, TOPK = 8, 64, 4


# -- client processes -----------------------------------------------------------
def zipf(seed):
    import numpy as np
    p = 1.0 / np.arange(1, EXPERTS + 1) ** 1.1
    p /= p.sum()
    rng = np.random.default_rng(seed)
    perms = [rng.permutation(EXPERTS) for _ in range(LAYERS)]   # popular experts per layer
    return p, perms


def worker(endpoint, ckpt, seed, name, out, deadline, think_ms, routing_seed):
    import numpy as np
    from safetensors import safe_open

    import k3client

    wm = json.load(open(os.path.join(ckpt, "model.safetensors.index.json")))["weight_map"]
    files = {f: safe_open(os.path.join(ckpt, f), "np") for f in set(wm.values())}
    p, perms = zipf(routing_seed)
    rng = np.random.default_rng(seed)
    refs: dict = {}
    f = open(out, "a", buffering=1)
    c = k3client.connect(endpoint, name=name)

    def reference(layer, expert):
        key = (layer, expert)
        if key not in refs:
            buf = bytearray(c.expert_bytes)
            for spec in c.layout:
                t = files[wm[f"model.layers.{layer}.mlp.experts.{expert}.{spec.name}"]].get_tensor(
                    f"model.layers.{layer}.mlp.experts.{expert}.{spec.name}")
                buf[spec.offset:spec.offset + spec.nbytes] = t.tobytes()
            refs[key] = np.frombuffer(bytes(buf), dtype=np.uint8)
        return refs[key]

    while time.time() < deadline:
        c.begin_token()
        lats = []
        for layer in range(LAYERS):
            experts = perms[layer][rng.choice(EXPERTS, TOPK, replace=False, p=p)]
            pred = None
            if layer + 1 < LAYERS:
                pred = [(layer + 1, int(e)) for e in perms[layer + 1][:2]]
            t0 = time.perf_counter()
            try:
                exs = c.fetch(layer, [int(e) for e in experts], predicted=pred)
            except (k3client.CacheFull, k3client.QuotaExceeded) as e:
                f.write(f"E {type(e).__name__}\n")
                break
            lats.append(time.perf_counter() - t0)
            for ex in exs:
                # numpy compare: memoryview == bytes goes item by item (20x slower)
                if not np.array_equal(np.frombuffer(ex.memory(), dtype=np.uint8), reference(ex.layer, ex.expert)):
                    f.write(f"W {ex.layer} {ex.expert}\n")
            del exs
            if think_ms:
                time.sleep(think_ms / 1000)
        f.write(f"L {time.time():.4f} " + " ".join(f"{x * 1e6:.0f}" for x in lats) + "\n")
    c.close()
    f.write("DONE\n")


def abuser(endpoint, seed, windows, deadline, quota, pause_ms, control):
    """One process for the whole run, started in the warm-up: it abuses only inside
    ``windows`` (the abusive segments) and between them holds nothing (its last token's
    pins released) and sends nothing, so no interpreter start-up lands in a measured
    segment.  ``control``: it never abuses (the measurement's own noise floor)."""
    import k3client

    rng = random.Random(seed)
    c = k3client.connect(endpoint, name="abuser")
    holding = False
    while time.time() < deadline:
        now = time.time()
        if control or not any(a <= now < b for a, b in windows):
            if holding:                 # out of its window: let go of its pins and predictions
                c.begin_token()
                holding = False
            time.sleep(0.01)
            continue
        c.begin_token()
        holding = True
        layer = rng.randrange(LAYERS)
        try:       # pin the whole quota with uniformly random, mostly cold experts
            c.fetch(layer, rng.sample(range(EXPERTS), min(quota, EXPERTS)))
        except (k3client.CacheFull, k3client.QuotaExceeded):
            pass
        c.predict([(rng.randrange(LAYERS), rng.randrange(EXPERTS)) for _ in range(512)])
        if pause_ms:
            time.sleep(pause_ms / 1000)
    c.close()


def flooder(endpoint, windows, deadline, control, out):
    """A client that floods the daemon with fetches inside ``windows`` and reads no reply
    (but hello's).  Sends block while ZeroMQ's queues are full (the daemon reads it no
    faster), so it costs the host what the daemon lets it.  Appends ``F sent again``
    (requests sent, and send waits that timed out) to ``out`` each second of its windows."""
    import os

    import zmq

    from k3client.protocol import PROTOCOL_VERSION, pack, unpack

    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDTIMEO, 50)          # a full queue: look at the clock again
    s.connect(endpoint)
    s.send(pack({"v": PROTOCOL_VERSION, "op": "hello", "id": 0, "name": "flood", "pid": os.getpid()}))
    hello = unpack(s.recv())
    beat = ctx.socket(zmq.DEALER)            # heartbeats, as k3client's lease thread sends them
    beat.setsockopt(zmq.LINGER, 0)
    beat.connect(endpoint)
    lease = hello["lease_s"] / 4
    sent = again = rid = 0
    next_beat = next_note = 0.0
    f = open(out, "a", buffering=1)
    while time.time() < deadline:
        now = time.time()
        if now >= next_beat:
            beat.send(pack({"v": PROTOCOL_VERSION, "op": "heartbeat", "id": 0,
                            "client_id": hello["client_id"], "gen": hello["gen"]}))
            next_beat = now + lease
        inside = not control and any(a <= now < b for a, b in windows)
        if inside and now >= next_note:
            f.write(f"F {sent} {again}\n")
            next_note = now + 1.0
        if not inside:
            time.sleep(0.01)
            continue
        rid += 1
        try:
            s.send(pack({"v": PROTOCOL_VERSION, "op": "fetch", "id": rid, "keys": [[0, rid % 4]]}))
            sent += 1
        except zmq.Again:
            again += 1
    f.write(f"F {sent} {again}\n")


# -- controller ------------------------------------------------------------------------
def spawn(args_list):
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), *map(str, args_list)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--slots", type=int, default=384)
    ap.add_argument("--pin-quota", type=int, default=32)
    ap.add_argument("--readers", type=int, default=None, help="default: the daemon's own choice")
    ap.add_argument("--think-ms", type=float, default=5.0, help="simulated compute per layer")
    ap.add_argument("--death-every", type=float, default=3.0, help="seconds between client kills")
    ap.add_argument("--segments", type=int, default=6, help="alternating without/with abuser")
    ap.add_argument("--warmup", type=float, default=10.0,
                    help="seconds before measuring: the cache fills and every client has met the popular experts "
                    "(with 3 s the first segment, always without the abuser, still measured the warm-up)")
    ap.add_argument("--abuser-pause-ms", type=float, default=0.0,
                    help="pause between the abuser's rounds (0: flat out, as hard as it can)")
    ap.add_argument("--control", action="store_true",
                    help="the abuser connects but does nothing: the ratio this run prints is the noise floor")
    ap.add_argument("--flood", action="store_true",
                    help="the abusive client floods requests without reading replies (bounded intake)")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    print(f"seed {seed} (rerun with --seed {seed})", flush=True)
    rng = random.Random(seed)

    import psutil

    import k3client
    from k3d.demo.synthetic import write_checkpoint

    ckpt = f"/tmp/k3d-load-ckpt-{LAYERS}x{EXPERTS}"
    if not os.path.exists(os.path.join(ckpt, "model.safetensors.index.json")):
        write_checkpoint(ckpt, layers=LAYERS, experts=EXPERTS, shards=4, seed=11)
    run = tempfile.mkdtemp(prefix="k3d-load-", dir="/tmp")
    endpoint = f"ipc://{run}/k.sock"
    log = open(os.path.join(run, "daemon.log"), "w")
    daemon = subprocess.Popen([sys.executable, "-P", "-m", "k3d", "start", "--source", ckpt, "--endpoint", endpoint,
                               "--slots", str(args.slots), "--pin-quota", str(args.pin_quota),
                               *(["--readers", str(args.readers)] if args.readers else []), "--lease", "5",
                               "--state-dir", "none"],        # starts cold; writes nothing into ~
                              stdout=log, stderr=subprocess.STDOUT)   # -P: the installed k3d
    while "k3d: ready" not in open(os.path.join(run, "daemon.log")).read():
        if daemon.poll() is not None:
            sys.exit(f"daemon failed:\n{open(os.path.join(run, 'daemon.log')).read()}")
        time.sleep(0.05)
    dproc = psutil.Process(daemon.pid)

    t_start = time.time() + 1.0
    t_measure = t_start + args.warmup
    seg_len = args.seconds / args.segments
    t_end = t_measure + args.seconds
    segments = [(t_measure + i * seg_len, t_measure + (i + 1) * seg_len, i % 2 == 1) for i in range(args.segments)]
    routing_seed = seed

    def new_worker(i):
        out = os.path.join(run, f"w{i}.log")
        return spawn(["--worker", endpoint, ckpt, rng.randrange(1 << 30), f"w{i}", out, t_end, args.think_ms,
                      routing_seed]), out

    windows = [(a, b) for a, b, abusive in segments if abusive]
    flood_out = os.path.join(run, "flood.log")
    if args.flood:
        ab = spawn(["--flooder", endpoint, json.dumps(windows), t_end, int(args.control), flood_out])
    else:
        ab = spawn(["--abuser", endpoint, rng.randrange(1 << 30), json.dumps(windows), t_end, args.pin_quota,
                    args.abuser_pause_ms, int(args.control)])
    workers = {i: new_worker(i) for i in range(args.clients)}
    outs = [o for _, o in workers.values()]
    next_id = args.clients
    deaths = 0
    rss: list[tuple[float, int]] = []
    next_death = t_start + args.death_every
    while time.time() < t_end:
        now = time.time()
        if now >= next_death:
            victim = rng.choice(sorted(workers))
            workers[victim][0].kill()
            workers[victim][0].wait()
            del workers[victim]
            workers[next_id] = new_worker(next_id)
            outs.append(workers[next_id][1])
            next_id += 1
            deaths += 1
            next_death += args.death_every
        rss.append((now, dproc.memory_info().rss))
        time.sleep(0.25)
    if ab is not None:
        ab.kill()
        ab.wait()
    for p, _ in workers.values():
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
    failed = [p.stderr.read()[-500:] for p, _ in workers.values() if p.returncode]

    # -- after every client exited: nothing may stay pinned -------------------------
    time.sleep(0.5)
    deadline = time.time() + 10
    with k3client.connect(endpoint, name="final-check") as c:
        while True:
            st = c.status()
            others = [x for x in st["clients"] if x["name"] != "final-check"]
            if (not others and st["arena"]["pinned"] == 0) or time.time() > deadline:
                break
            time.sleep(0.2)
    daemon.send_signal(signal.SIGTERM)
    rc = daemon.wait(60)

    # -- figures ----------------------------------------------------------------------
    lat = {False: [], True: []}
    wrong = errors = fetches = 0
    for out in outs:
        if not os.path.exists(out):       # killed before it started
            continue
        for line in open(out):
            if line.startswith("W "):
                wrong += 1
            elif line.startswith("E "):
                errors += 1
            elif line.startswith("L "):
                parts = line.split()
                t, xs = float(parts[1]), [int(x) / 1000 for x in parts[2:]]
                fetches += len(xs)
                for a, b, abusive in segments:
                    if a <= t < b:
                        lat[abusive].extend(xs)
    window = 60.0 if args.seconds >= 120 else 10.0
    first = [r for t, r in rss if t_measure <= t < t_measure + window]
    last = [r for t, r in rss if t_end - window <= t < t_end]
    growth = statistics.mean(last) / statistics.mean(first) - 1 if first and last else float("nan")
    p99 = {k: pct(v, 0.99) for k, v in lat.items()}
    ratio = p99[True] / p99[False]
    s = st["stats"]
    hit = s["hits"] / max(1, s["hits"] + s["misses"])
    print(f"{args.clients} clients, {args.seconds:g} s measured in {args.segments} alternating segments "
          f"(+{args.warmup:g} s warm-up), {deaths} clients killed with SIGKILL, think {args.think_ms:g} ms/layer")
    print(f"fetches verified: {fetches} ({wrong} wrong), cache_full/quota errors: {errors}, "
          f"daemon hit rate {hit:.1%}, {s['evictions']} evictions, {s['clients_dead']} dead clients reaped")
    who = "flood" if args.flood else "abuser"
    for abusive in (False, True):
        xs = lat[abusive]
        print(f"well-behaved fetch latency {'with' if abusive else 'without'} {who}: n={len(xs)} "
              f"p50 {pct(xs, 0.5):.3f} ms  p99 {pct(xs, 0.99):.3f} ms")
    print(f"p99 with/without {who}: {ratio:.3f} (goal <= 1.25)")
    if args.flood:
        lines = open(flood_out).read().split() if os.path.exists(flood_out) else []
        sent, again = (int(lines[-2]), int(lines[-1])) if len(lines) >= 3 else (0, 0)
        print(f"flood: {sent} requests sent ({again} sends waited {50} ms for room), "
              f"{s.get('requests_over_cap', 'n/a')} over the cap, {s['replies_dropped']} replies dropped")
    print(f"daemon RSS first {window:g} s {statistics.mean(first) / 2**20:.1f} MiB, last {window:g} s "
          f"{statistics.mean(last) / 2**20:.1f} MiB: growth {growth:+.2%} (goal <= 5%)")
    print(f"after exit: {len(others)} clients, {st['arena']['pinned']} pinned slots (goal 0); daemon exit {rc}")
    print(f"pacing: clients over their CPU share were held back {s.get('paced', 0)} times, "
          f"{s.get('paced_seconds', 0):.1f} s in all")
    if failed:
        print(f"{len(failed)} workers failed: {failed[:2]}")
    ok = (wrong == 0 and not others and st["arena"]["pinned"] == 0 and growth <= 0.05 and ratio <= 1.25
          and rc == 0 and not failed)
    print("PASS" if ok else "FAIL")
    log.close()
    if ok:
        shutil.rmtree(run, ignore_errors=True)     # the daemon's and workers' logs: kept for a failure
    else:
        print(f"logs: {run}")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        a = sys.argv[2:]
        worker(a[0], a[1], int(a[2]), a[3], a[4], float(a[5]), float(a[6]), int(a[7]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--flooder":
        a = sys.argv[2:]
        flooder(a[0], json.loads(a[1]), float(a[2]), bool(int(a[3])), a[4])
    elif len(sys.argv) > 1 and sys.argv[1] == "--abuser":
        a = sys.argv[2:]
        abuser(a[0], int(a[1]), json.loads(a[2]), float(a[3]), int(a[4]), float(a[5]), bool(int(a[6])))
    else:
        sys.exit(main())
