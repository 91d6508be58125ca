"""Remote origin: k3d cold fetches over HTTP (nginx, loopback) vs the floor and the naive loader;
disk-cache hits vs a local packed file.

    python bench/http_read.py [--mb 320] [--reps 5] [--readers 4] [--batch 16]

A synthetic MXFP4-shaped checkpoint of about ``--mb`` MB (2 safetensors shards +
index.json, ~3.3 MB per expert; cached under /tmp/k3d-bench-http) is served by
nginx on 127.0.0.1 (files page-cache warm: this measures the HTTP path, not the
disk).  In one run, interleaved rep by rep in rotating order:

- floor:  ``--readers`` threads, each with one persistent http.client connection,
          one single-range GET per expert (its byte span, from the header parsed
          here) read with ``readinto`` into an already-touched buffer;
- naive:  one ``urllib.request`` per tensor (Range of that tensor), one expert at
          a time, each expert written to its own file (what a simple lazy
          loader does);
- k3d:    a real ``k3d start --source http://.../ --http-conns --readers``
          (arena a quarter of the checkpoint and ``--policy lru``, so a sequential
          scan misses on every key), one client fetching ``--batch`` keys per fetch;
- disk:   the same with ``--disk-cache`` filled by a first pass: every fetch is a
          disk-tier hit (entry files' page cache dropped before each pass);
- packed: ``k3d start`` on the local ``.k3pack`` of the same checkpoint
          (``--read-mode buffered``, page cache dropped before each pass).

Reported: GB/s per method (median over reps) and ratios (median of per-rep ratios).
Targets: k3d >= 0.8x floor, >= 3x naive; disk >= 0.8x packed.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import harness  # noqa: E402

import k3client  # noqa: E402
from faulty_http import Nginx  # noqa: E402
from k3d.config import DEFAULT_PATTERN, Config  # noqa: E402
from k3d.sources import open_source  # noqa: E402
from k3d.sources.packwrite import write_pack  # noqa: E402

CACHE = "/tmp/k3d-bench-http"


def build(mb: int) -> tuple[str, str]:
    from k3d.demo.synthetic import write_checkpoint
    experts = max(8, round(mb * 1e6 / 3.3e6 / 4))
    ck = os.path.join(CACHE, f"ck-{experts}")
    pack = ck + ".k3pack"
    if not os.path.exists(os.path.join(ck, "model.safetensors.index.json")):
        os.makedirs(CACHE, exist_ok=True)
        write_checkpoint(ck, layers=4, experts=experts, hidden=2048, inter=1024, shards=2, seed=1)
    if not os.path.exists(pack):
        src = open_source(ck, DEFAULT_PATTERN)
        try:
            write_pack(src, pack, progress=False)
        finally:
            src.close()
    return ck, pack


def spans(ck: str):
    """[(shard file name, key, expert span (offset, nbytes), [tensor (offset, nbytes)])] in key order."""
    with open(os.path.join(ck, "model.safetensors.index.json")) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    out = []
    for s in shards:
        path = os.path.join(ck, s)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        tensors: dict = {}
        for name, t in header.items():
            if ".mlp.experts." in name:
                p = name.split(".")
                b, e = t["data_offsets"]
                tensors.setdefault((int(p[2]), int(p[5])), []).append((8 + n + b, e - b))
        for key, ts in sorted(tensors.items()):
            lo = min(o for o, _ in ts)
            hi = max(o + ln for o, ln in ts)
            assert hi - lo == sum(ln for _, ln in ts), "synthetic experts are contiguous"
            out.append((s, key, (lo, hi - lo), sorted(ts)))
    return out


def floor_pass(base: str, items, threads: int) -> float:
    host, path = base.split("/")[2], "/" + base.split("/", 3)[3]
    it, lock = iter(items), threading.Lock()
    size = max(sp[1] for _, _, sp, _ in items)

    def run(_):
        conn = http.client.HTTPConnection(host, timeout=30)
        buf = memoryview(bytearray(size))
        buf[:] = bytes(size)
        while True:
            with lock:
                item = next(it, None)
            if item is None:
                conn.close()
                return
            shard, _, (off, n), _ = item
            conn.request("GET", path + shard, headers={"Range": f"bytes={off}-{off + n - 1}"})
            r = conn.getresponse()
            assert r.status == 206
            got = 0
            while got < n:
                k = r.readinto(buf[got:n])
                assert k
                got += k
    return harness.timed_threads(run, threads)


def naive_pass(base: str, items, out_dir: str) -> float:
    t0 = time.perf_counter()
    for shard, key, _, tensors in items:
        with open(os.path.join(out_dir, f"{key[0]}-{key[1]}.bin"), "wb") as f:
            for off, n in tensors:
                req = urllib.request.Request(base + shard, headers={"Range": f"bytes={off}-{off + n - 1}"})
                with urllib.request.urlopen(req) as r:
                    f.write(r.read())
    return time.perf_counter() - t0


def k3d_pass(client, keys, batch) -> tuple[float, int]:
    before = client.status()["stats"]["misses"]
    by_layer: dict[int, list[int]] = {}
    for l, e in keys:
        by_layer.setdefault(l, []).append(e)
    t0 = time.perf_counter()
    for layer, experts in by_layer.items():
        for i in range(0, len(experts), batch):
            client.begin_token()
            client.fetch(layer, experts[i:i + batch])
    dt = time.perf_counter() - t0
    client.begin_token()
    return dt, client.status()["stats"]["misses"] - before


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=320)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--readers", type=int, default=None,
                    help="k3d --readers and --http-conns (default: the daemon's defaults; the floor then "
                         "uses --http-conns' default connections, the parallelism the origin sees)")
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    given = args.readers
    args.readers = args.readers or Config.http_conns

    ck, pack = build(args.mb)
    items = spans(ck)
    keys = [k for _, k, _, _ in items]
    total = sum(sp[1] for _, _, sp, _ in items)
    for f in os.listdir(ck):
        harness.warm_page_cache(os.path.join(ck, f))
    work = tempfile.mkdtemp(prefix="k3d-bench-http-", dir="/tmp")
    dc = os.path.join(work, "dc")
    naive_dir = os.path.join(work, "naive")
    os.makedirs(naive_dir)
    methods = ["floor", "naive", "k3d", "disk", "packed"]
    results: dict[str, list[float]] = {m: [] for m in methods}
    with Nginx(os.path.dirname(ck), workers=2) as ng:
        base = ng.url + os.path.basename(ck) + "/"
        sb = open_source(ck, DEFAULT_PATTERN)
        slot = sb.expert_bytes
        sb.close()
        stride = (slot + 4095) // 4096 * 4096
        arena = max(args.batch * 2, len(keys) // 4) * stride
        harness.banner("http_read", f"{ck}: {len(keys)} experts, {total / 1e6:.0f} MB over nginx {base}; "
                                    f"{args.readers} readers/conns, batch {args.batch}, {args.reps} reps")
        # --policy lru: every pass is a sequential scan over more keys than slots, which LRU
        # misses on every key; the default cycle policy keeps some of them resident, and
        # this bench measures the read paths (origin, disk tier, pack), not the policy
        common = ("--arena", arena, "--policy", "lru", *(("--http-conns", given) if given else ()))
        specs = {
            "k3d": (base, *common),
            "disk": (base, *common, "--disk-cache", dc, "--disk-cache-size", "4GiB"),
            "packed": (pack, "--arena", arena, "--policy", "lru", "--read-mode", "buffered"),
        }
        daemons, clients = {}, {}
        try:
            for m, spec in specs.items():
                daemons[m] = harness.Daemon(*spec, readers=given)
                clients[m] = k3client.connect(daemons[m].endpoint, name=f"http-{m}")
            # fill the disk tier (origin fetches), then let the writer finish
            k3d_pass(clients["disk"], keys, args.batch)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                d = clients["disk"].status()["model"]["tiers"]["disk"]
                if d["entries"] == len(keys) and d["write_backlog_bytes"] == 0:
                    break
                time.sleep(0.1)

            def measure(m: str) -> float:
                if m == "floor":
                    return floor_pass(base, items, args.readers)
                if m == "naive":
                    return naive_pass(base, items, naive_dir)
                if m == "disk":
                    for f in os.listdir(dc):
                        if f.endswith(".k3e"):
                            harness.drop_page_cache(os.path.join(dc, f))
                if m == "packed":
                    harness.drop_page_cache(pack)
                dt, misses = k3d_pass(clients[m], keys, args.batch)
                if misses != len(keys):
                    raise SystemExit(f"{m}: pass had {misses} misses of {len(keys)} keys")
                return dt

            for rep in range(args.reps):
                order = methods[rep % len(methods):] + methods[:rep % len(methods)]
                for m in order:
                    results[m].append(total / measure(m) / 1e9)
                harness.banner("http_read", f"rep {rep + 1}: " + "  ".join(
                    f"{m} {results[m][-1]:.2f}" for m in methods) + " GB/s")
            tiers = {m: clients[m].status()["model"].get("tiers") for m in ("k3d", "disk")}
        finally:
            for c in clients.values():
                c.close()
            for d in daemons.values():
                d.stop()
            shutil.rmtree(work, ignore_errors=True)
    med = {m: harness.median(v) for m, v in results.items()}
    ratio = {
        "k3d/floor": harness.median([a / b for a, b in zip(results["k3d"], results["floor"])]),
        "k3d/naive": harness.median([a / b for a, b in zip(results["k3d"], results["naive"])]),
        "disk/packed": harness.median([a / b for a, b in zip(results["disk"], results["packed"])]),
    }
    print("\nmethod   GB/s (median of %d)" % args.reps)
    for m in methods:
        print(f"{m:8s} {med[m]:6.2f}")
    print(f"\nk3d / floor  = {ratio['k3d/floor']:.2f}x  (target >= 0.8)  {harness.verdict(ratio['k3d/floor'] >= 0.8)}")
    print(f"k3d / naive  = {ratio['k3d/naive']:.2f}x  (target >= 3)    {harness.verdict(ratio['k3d/naive'] >= 3)}")
    print(f"disk / packed = {ratio['disk/packed']:.2f}x (target >= 0.8)  "
          f"{harness.verdict(ratio['disk/packed'] >= 0.8)}")
    o = tiers["k3d"]["origin"]
    print(f"k3d origin: {o['fetches']} fetches, {o['requests']} requests, {o['retries']} retries, "
          f"{o['errors']} errors; disk tier: {tiers['disk']['disk']['hits']} hits")
    return 0


if __name__ == "__main__":
    sys.exit(main())
