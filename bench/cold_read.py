"""Cold misses: k3d ``direct`` and ``buffered`` against the O_DIRECT floor and mmap demand paging.

    python bench/cold_read.py [--mb 400] [--reps 12] [--readers 4] [--batch 16] [--predict]

One packed file of about ``--mb`` MB (a synthetic MXFP4 checkpoint written by
safetensors, converted by ``k3d pack``; cached under /tmp/k3d-bench-cold).
Before every measured pass the file's page cache is dropped
(``posix_fadvise(POSIX_FADV_DONTNEED)`` on the whole file), so every byte
comes from the disk.  In one run, interleaved rep by rep:

- floor:    ``--readers`` threads, raw ``os.preadv`` of whole experts from an
            O_DIRECT fd into page-aligned, already-touched buffers;
- mmap:     the same threads copy each expert out of an mmap of the file
            (demand paging with kernel readahead: what llama.cpp-style loading does);
- mmap1:    the same with one thread (a loader touching the mapping in order);
- k3d direct / buffered: a real ``k3d start --read-mode MODE`` (arena a quarter
            of the file, so a sequential scan misses on every key), one client
            fetching every expert in (layer, expert) order, ``--batch`` keys per
            fetch, ``begin_token`` between fetches.  Each pass must be all misses;
- predict (``--predict``): k3d direct with each fetch naming the next batch as
            ``predicted=``, so reads run while the client handles replies.

Reported: GB/s per method (median over reps) and the ratios (median of the
per-rep ratios: the methods run back to back in each rep, in rotating order,
so slow drift on a shared disk cancels out).
Targets (issue 3): direct >= 0.9x the O_DIRECT floor and >= 2.5x mmap.
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import harness  # noqa: E402
import k3client  # noqa: E402
from k3d.packed import read_header, write_pack  # noqa: E402
from k3d.config import DEFAULT_PATTERN  # noqa: E402
from k3d.sources import open_source  # noqa: E402

CACHE = "/tmp/k3d-bench-cold"


def build(mb: int) -> str:
    """A packed file of about ``mb`` MB: 4 layers, hidden 2048, inter 1024 (~3.3 MB per expert)."""
    from k3d.synthetic import write_checkpoint

    experts = max(4, round(mb * 1e6 / 3.3e6 / 4))
    out = os.path.join(CACHE, f"cold-{experts}.k3pack")
    if os.path.exists(out):
        return out
    os.makedirs(CACHE, exist_ok=True)
    ck = os.path.join(CACHE, f"ckpt-{experts}")
    write_checkpoint(ck, layers=4, experts=experts, hidden=2048, inter=1024, seed=1)
    src = open_source(ck, DEFAULT_PATTERN)
    try:
        write_pack(src, out, progress=True)
    finally:
        src.close()
    for f in os.listdir(ck):
        os.unlink(os.path.join(ck, f))
    os.rmdir(ck)
    return out


def parallel(offsets, threads: int, work) -> float:
    """Run ``work(i, offset)`` over offsets on ``threads`` threads; returns seconds."""
    it, lock = iter(offsets), threading.Lock()

    def run(i):
        while True:
            with lock:
                off = next(it, None)
            if off is None:
                return
            work(i, off)

    return harness.timed_threads(run, threads)


def floor_odirect(path, offsets, stride, threads) -> float:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    bufs = [mmap.mmap(-1, stride) for _ in range(threads)]
    views = [memoryview(b) for b in bufs]
    for v in views:
        v[:] = bytes(stride)          # touched, like the pre-faulted arena

    def work(i, off):
        done = 0
        while done < stride:
            n = os.preadv(fd, [views[i][done:]], off + done)
            if n <= 0:
                raise OSError("short O_DIRECT read")
            done += n
    try:
        return parallel(offsets, threads, work)
    finally:
        for v in views:
            v.release()
        os.close(fd)


def demand_paging(path, offsets, stride, threads) -> float:
    fd = os.open(path, os.O_RDONLY)
    mm = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ)
    src = np.frombuffer(mm, np.uint8)
    dests = [np.ones(stride, np.uint8) for _ in range(threads)]

    def work(i, off):
        np.copyto(dests[i], src[off:off + stride])    # page faults + readahead; GIL released
    try:
        return parallel(offsets, threads, work)
    finally:
        src = None          # drop the export before closing the map
        mm.close()
        os.close(fd)


def k3d_pass(client, keys, batch, predict=False) -> tuple[float, int]:
    """Fetch every key once in order (``predict``: name the next batch as predicted); (seconds, misses)."""
    before = client.status()["stats"]["misses"] + (client.status()["stats"]["prefetched"] if predict else 0)
    batches = []
    by_layer: dict[int, list[int]] = {}
    for l, e in keys:
        by_layer.setdefault(l, []).append(e)
    for layer, experts in by_layer.items():
        batches += [(layer, experts[i:i + batch]) for i in range(0, len(experts), batch)]
    t0 = time.perf_counter()
    for i, (layer, experts) in enumerate(batches):
        client.begin_token()
        nxt = [(batches[i + 1][0], e) for e in batches[i + 1][1]] if predict and i + 1 < len(batches) else None
        client.fetch(layer, experts, predicted=nxt)
    dt = time.perf_counter() - t0
    client.begin_token()
    st = client.status()["stats"]
    # a predicted key read ahead counts as prefetched, not as a miss: both came cold from disk
    return dt, st["misses"] + (st["prefetched"] if predict else 0) - before


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=400)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--readers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--predict", action="store_true",
                    help="also run k3d direct with the next batch passed as predicted= (reads overlap the client)")
    args = ap.parse_args()

    path = build(args.mb)
    h, size = read_header(path)
    stride, n = h["stride"], len(h["keys"])
    keys = [tuple(k) for k in h["keys"]]
    offsets = [h["data_offset"] + i * stride for i in range(n)]
    total = n * stride
    harness.banner("cold_read", f"{path}: {n} experts x {stride} bytes = {total / 1e6:.0f} MB; "
                                f"{args.readers} threads, batch {args.batch}, {args.reps} reps")
    arena = max(args.batch * 2, n // 4) * stride
    methods = ["floor", "mmap", "mmap1", "direct", "buffered"] + (["predict"] if args.predict else [])
    results: dict[str, list[float]] = {m: [] for m in methods}
    daemons = {m: harness.Daemon(path, "--read-mode", m, "--arena", arena, readers=args.readers)
               for m in ("direct", "buffered")}
    clients = {m: k3client.connect(d.endpoint, name=f"cold-{m}") for m, d in daemons.items()}

    def measure(m: str) -> float:
        harness.drop_page_cache(path)
        if m == "floor":
            return floor_odirect(path, offsets, stride, args.readers)
        if m in ("mmap", "mmap1"):
            return demand_paging(path, offsets, stride, args.readers if m == "mmap" else 1)
        dt, misses = k3d_pass(clients["direct" if m == "predict" else m], keys, args.batch, m == "predict")
        if misses != n:
            raise SystemExit(f"k3d {m}: pass had {misses} misses of {n} keys (arena too large?)")
        return dt

    try:
        for rep in range(args.reps):
            # rotate the order so drift on a shared disk does not favour one method
            order = methods[rep % len(methods):] + methods[:rep % len(methods)]
            for m in order:
                results[m].append(total / measure(m) / 1e9)
            harness.banner("cold_read", f"rep {rep + 1}: " + "  ".join(f"{m} {results[m][-1]:.2f}" for m in methods)
                           + " GB/s")
    finally:
        for c in clients.values():
            c.close()
        for d in daemons.values():
            d.stop()
    med = {m: harness.median(v) for m, v in results.items()}

    def ratio(a, b):
        """Median of the per-rep ratios (paired: both measured in the same rep)."""
        return harness.median([x / y for x, y in zip(results[a], results[b])])

    print()
    print(f"{'method':<36}{'GB/s (median)':>14}{'x floor':>10}{'x mmap':>10}{'x mmap1':>10}")
    for m, label in (("floor", "O_DIRECT preadv (floor)"), ("mmap", f"mmap demand paging, {args.readers} threads"),
                     ("mmap1", "mmap demand paging, 1 thread"), ("direct", "k3d --read-mode direct"),
                     ("buffered", "k3d --read-mode buffered"), ("predict", "k3d direct, predicted= next batch")):
        if m not in med:
            continue
        print(f"{label:<36}{med[m]:>14.2f}{ratio(m, 'floor'):>10.2f}{ratio(m, 'mmap'):>10.2f}{ratio(m, 'mmap1'):>10.2f}")
    print("(ratios are medians of per-rep ratios)")
    r_floor, r_mmap, r_mmap1 = ratio("direct", "floor"), ratio("direct", "mmap"), ratio("direct", "mmap1")
    print(f"\ntarget direct >= 0.9x floor:            {r_floor:.2f}x  {harness.verdict(r_floor >= 0.9)}")
    print(f"target direct >= 2.5x mmap ({args.readers} threads):  {r_mmap:.2f}x  {harness.verdict(r_mmap >= 2.5)}")
    print(f"target direct >= 2.5x mmap (1 thread):   {r_mmap1:.2f}x  {harness.verdict(r_mmap1 >= 2.5)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
