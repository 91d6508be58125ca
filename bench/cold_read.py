"""Cold misses: k3d ``direct`` and ``buffered`` against the O_DIRECT floor and mmap demand paging.

    python bench/cold_read.py [--layers 2] [--experts 24] [--batch 4] [--reps 9] [--readers 8] [--seed 1]

One packed file of gpt-oss-shaped MXFP4 experts (hidden = inter = 2880:
13.2 MB each; 2 x 24 of them = 634 MB by default), written by safetensors and
converted by ``k3d pack`` (cached under /tmp/k3d-bench-cold).  Every method
reads the same experts in the same batches; a batch is ``--batch`` experts of
one layer (one MoE layer's top-k of one token).  Two access patterns, each
reading every expert once per pass:

- routed: each layer's experts in a seeded random order, layers interleaved
          (a token's routed experts: where the misses of a serving model are);
- scan:   file order (a loader walking the checkpoint: the best case for
          kernel readahead, which then reads the next batch early).

The targets are judged on ``routed`` (that is how misses arrive); ``scan``
is printed as information.

Methods, one batch at a time, the order rotating from batch to batch, the
file's page cache dropped (``posix_fadvise(POSIX_FADV_DONTNEED)``) before every
method's turn, so every byte comes from the disk and each method meets the
disk in the same state as the others within milliseconds:

- floor:    ``--readers`` persistent threads, raw ``os.preadv`` of each part
            (a batch cut into parts as k3d's server cuts it) from an O_DIRECT
            fd, ``--request`` bytes at a time (default: k3d's request size),
            into slots of a ``k3d.memory.arena.Arena`` (memory allocated as the
            daemon's is);
- floorcrc: the floor plus what every verifying reader must do: each thread's
            pieces go to a ``k3d.checksum.CrcPipeline`` companion as k3d's do,
            and each expert's part crcs are combined and checked against the
            header (the price of read-time verification on this machine;
            direct / floorcrc is k3d's own overhead beyond it);
- mmap:     ``--readers`` threads copy the batch's parts out of a fresh mmap of
            the file (demand paging with the kernel's readahead: what
            llama.cpp-style loading does), then unmap;
- mmap2x:   the same with twice as many threads (more faults in flight read
            faster here: the most generous mmap measured);
- mmap1:    the same with one thread (a compute thread faulting its weights in);
- direct / buffered: a real ``k3d start --read-mode MODE`` (an arena of
            ``batch`` slots: each fetch evicts the last one), one client:
            ``begin_token`` (untimed), then one timed ``fetch(layer, batch)``.
            A pass that is not all misses is an error.

Memory: O_DIRECT speed on this VM depends on how physically contiguous the
destination pages are, so the floor reads into an arena allocated as the
daemon's is, after compacting free memory (root only); the banner prints the
physical runs per slot of both, from /proc/PID/pagemap.

Per pass, a method's GB/s is the bytes of the pass over the sum of its batch
times.  Ratios are medians over passes of per-pass ratios (paired: the two
methods read the same batches, interleaved).  Targets: direct >=
0.9x the O_DIRECT floor, and >= 2.5x mmap demand paging; the 2.5x verdict is
against the fastest of ``mmap``, ``mmap2x`` and ``mmap1`` in each pass.
``floor / fastest mmap`` is printed too: no reader can beat the floor, so where it is under 2.5x the
mmap target is out of reach for any reader on that disk and pattern; and ``direct / floorcrc``:
what k3d costs beyond the read-time verification that the packed format requires.
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import queue
import random
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
import numpy as np  # noqa: E402

import k3client  # noqa: E402
from k3d.config import DEFAULT_PATTERN  # noqa: E402
from k3d.memory.arena import Arena, hugepages  # noqa: E402
from k3d.reads.plan import parts_per_key, readers_for, split_extents  # noqa: E402
from k3d.sources import Extent, open_source  # noqa: E402
from k3d.sources.checksum import CrcPipeline, crc32_of_parts  # noqa: E402
from k3d.sources.packed import CHUNK, PackedSource, read_header  # noqa: E402
from k3d.sources.packwrite import write_pack  # noqa: E402

CACHE = "/tmp/k3d-bench-cold"
HIDDEN = INTER = 2880           # gpt-oss: 13.2 MB MXFP4 experts
METHODS = ("floor", "floorcrc", "mmap", "mmap2x", "mmap1", "direct", "buffered")
MMAPS = {"mmap": 1, "mmap2x": 2}          # threads: this many times --readers ("mmap1": one)
LABELS = {"floor": "O_DIRECT preadv (floor)", "floorcrc": "O_DIRECT preadv + crc32 check",
          "mmap": "mmap demand paging, {r} threads",
          "mmap2x": "mmap demand paging, {r2} threads", "mmap1": "mmap demand paging, 1 thread",
          "direct": "k3d --read-mode direct",
          "buffered": "k3d --read-mode buffered"}


def build(layers: int, experts: int) -> str:
    """The packed file (built once, then reused from CACHE)."""
    from k3d.demo.synthetic import write_checkpoint

    out = os.path.join(CACHE, f"gptoss-{layers}x{experts}.k3pack")
    if os.path.exists(out):
        return out
    os.makedirs(CACHE, exist_ok=True)
    ck = os.path.join(CACHE, f"ckpt-{layers}x{experts}")
    write_checkpoint(ck, layers=layers, experts=experts, hidden=HIDDEN, inter=INTER, seed=1)
    src = open_source(ck, DEFAULT_PATTERN)
    try:
        write_pack(src, out, progress=True)
    finally:
        src.close()
    for f in os.listdir(ck):
        os.unlink(os.path.join(ck, f))
    os.rmdir(ck)
    return out


def batches(keys, batch: int, pattern: str, seed: int) -> list[tuple[int, list[int]]]:
    """Every key once, as (layer, experts) batches of one layer each."""
    by_layer: dict[int, list[int]] = {}
    for l, e in keys:
        by_layer.setdefault(l, []).append(e)
    per_layer = {l: [(l, es[i:i + batch]) for i in range(0, len(es), batch)]
                 for l, es in by_layer.items()}
    if pattern == "scan":
        return [b for l in sorted(per_layer) for b in per_layer[l]]
    rng = random.Random(seed)
    for l, es in by_layer.items():
        rng.shuffle(es)
        per_layer[l] = [(l, es[i:i + batch]) for i in range(0, len(es), batch)]
    out, i = [], 0                       # token by token: layer 0's batch, layer 1's, ...
    while any(i < len(v) for v in per_layer.values()):
        out += [per_layer[l][i] for l in sorted(per_layer) if i < len(per_layer[l])]
        i += 1
    return out


class ThreadPool:
    """``threads`` persistent threads; ``run(items, work)`` calls ``work(thread, item)`` on each
    item and returns the seconds from hand-out to the last completion."""

    def __init__(self, threads: int):
        self.threads = threads
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(threads):
            threading.Thread(target=self._loop, args=(i,), daemon=True).start()

    def _loop(self, i: int) -> None:
        while True:
            item, work = self.jobs.get()
            try:
                work(i, item)
                self.done.put(None)
            except BaseException as e:          # surfaced by run()
                self.done.put(e)

    def run(self, items, work) -> float:
        t0 = time.perf_counter()
        for it in items:
            self.jobs.put((it, work))
        errors = [e for e in (self.done.get() for _ in items) if e is not None]
        dt = time.perf_counter() - t0
        if errors:
            raise errors[0]
        return dt


class RawReaders:
    """The floor and the mmap baselines over one file, with ``threads`` persistent threads.

    A batch is cut into jobs as k3d's server cuts it: with more threads than experts,
    each expert into ``threads // experts`` (at most 8) page-aligned parts, one job each."""

    def __init__(self, path: str, stride: int, threads: int, batch: int, huge: bool, thp: bool):
        self.path, self.stride, self.threads = path, stride, threads
        self.dfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        self.fd = os.open(path, os.O_RDONLY)
        self.pool = ThreadPool(threads)
        self.pools = {1: ThreadPool(1), 2 * threads: ThreadPool(2 * threads), threads: self.pool}
        # The floor reads into memory allocated exactly as k3d's arena is (a fallocated,
        # pre-faulted memfd): on this VM a request's speed depends on how physically
        # contiguous its pages are (a virtio request carries at most 254 segments): pages
        # in ~14 runs per 13 MB read at 2.7 GB/s where ~1000 runs read at 1.9 GB/s.
        self.arena = Arena(batch, stride, huge=huge, thp=thp)
        self.views = [self.arena.view(i) for i in range(batch)]
        self.dests = [np.ones(stride, np.uint8) for _ in range(batch)]
        self.crcs = [CrcPipeline(f"floor-crc-{i}") for i in range(threads)]   # one per pool thread

    def jobs(self, offsets, threads: int):
        """(expert index in batch, file offset of the part, offset in the expert, length)."""
        parts = parts_per_key(threads, len(offsets), PackedSource.max_parts)      # as the server does
        return [(j, e.offset, e.slot_offset, e.length) for j, off in enumerate(offsets)
                for group in split_extents([Extent(0, off, 0, self.stride)], parts) for e in group]

    def floor(self, offsets, request: int) -> float:
        def work(_, job):
            j, off, start, length = job
            done = 0
            while done < length:
                n = os.preadv(self.dfd, [self.views[j][start + done:start + min(length, done + request)]], off + done)
                if n <= 0:
                    raise OSError(f"short O_DIRECT read at {off + done}")
                done += n
        return self.pool.run(self.jobs(offsets, self.threads), work)

    def floor_crc(self, offsets, request: int, expected: list[int]) -> float:
        """The floor, checksummed as k3d checksums: the batch fails if an expert's crc is wrong."""
        parts: dict[int, list] = {j: [] for j in range(len(offsets))}

        def work(i, job):
            j, off, start, length = job
            crcs, done = self.crcs[i], 0
            try:
                while done < length:
                    piece = self.views[j][start + done:start + min(length, done + request)]
                    n = os.preadv(self.dfd, [piece], off + done)
                    if n != len(piece):
                        raise OSError(f"short O_DIRECT read at {off + done}")
                    crcs.feed(piece)
                    done += n
            finally:
                crc = crcs.finish()
            parts[j].append((start, length, crc))        # list.append: atomic under the GIL
            if sum(p[1] for p in parts[j]) == self.stride:   # the part that completes the expert checks it
                whole = crc32_of_parts(parts[j])
                if whole != expected[j]:
                    raise ValueError(f"floorcrc: crc32 {whole:08x} of the expert at {off - start} "
                                     f"is not the header's {expected[j]:08x}")
        return self.pool.run(self.jobs(offsets, self.threads), work)

    def demand_paging(self, offsets, threads: int) -> float:
        mm = mmap.mmap(self.fd, 0, mmap.MAP_SHARED, mmap.PROT_READ)
        src = np.frombuffer(mm, np.uint8)

        def work(_, job):       # page faults + readahead; GIL released
            j, off, start, length = job
            np.copyto(self.dests[j][start:start + length], src[off:off + length])
        try:
            return self.pools[threads].run(self.jobs(offsets, threads), work)
        finally:
            src = None                   # drop the export before unmapping: mapped pages would
            mm.close()                   # otherwise survive the next drop and feed other methods

    def close(self) -> None:
        for c in self.crcs:
            c.close()
        self.dests = []
        for v in self.views:
            v.release()
        self.arena.close()
        os.close(self.dfd)
        os.close(self.fd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=24, help="experts per layer")
    ap.add_argument("--batch", type=int, default=4, help="experts per fetch (one layer's top-k)")
    ap.add_argument("--reps", type=int, default=9, help="passes per pattern")
    ap.add_argument("--readers", type=int, default=None,
                    help="k3d readers = floor and mmap threads (default: the daemon's own choice for packed "
                         "files, k3d.reads.plan.readers_for)")
    ap.add_argument("--seed", type=int, default=1, help="routed order")
    ap.add_argument("--patterns", default="routed,scan")
    ap.add_argument("--hugepages", action="store_true",
                    help="floor buffers and both daemons' arenas in hugetlb pages (reserves them; root)")
    ap.add_argument("--no-thp", dest="thp", action="store_false",
                    help="floor buffers and both daemons' arenas in plain 4 KiB pages (k3d start --no-thp)")
    ap.add_argument("--request", type=int, default=CHUNK,
                    help="floor: bytes per preadv (default: k3d's request size, k3d.sources.packed.CHUNK)")
    args = ap.parse_args()
    args.given_readers = args.readers
    args.readers = args.readers or readers_for("packed", os.cpu_count())

    path = build(args.layers, args.experts)
    h, _ = read_header(path)
    stride, keys = h["stride"], [tuple(k) for k in h["keys"]]
    index = {k: i for i, k in enumerate(keys)}
    offset = {k: h["data_offset"] + i * stride for k, i in index.items()}
    crcs = {k: h["_crcs"][i] for k, i in index.items()}
    total = len(keys) * stride
    harness.banner("cold_read", f"{path}: {len(keys)} experts x {stride} bytes = {total / 1e6:.0f} MB; "
                                f"{args.readers} threads, batch {args.batch}, {args.reps} passes per pattern, "
                                f"seed {args.seed}")
    with contextlib.ExitStack() as stack:
        if args.hugepages:
            huge_page = hugepages()[0]
            # floor + two daemons, and a little slack: once (right after the pack was
            # written) a daemon found one page fewer free than was reserved
            stack.enter_context(harness.hugepages_reserved(3 * -(-args.batch * stride // huge_page) + 4))
        return measure(args, path, stride, keys, offset, crcs, total)


def measure(args, path, stride, keys, offset, crcs, total) -> int:
    # O_DIRECT speed here depends on how physically contiguous the destination pages are
    # (see RawReaders), which depends on who allocates first from fragmented free memory:
    # compact it first, then give the floor and the daemons their memory, and show both.
    patterns = args.patterns.split(",")
    # (with --hugepages the reservation has just compacted, and it only succeeds as root)
    compacted = args.hugepages or harness.compact_memory()
    raw = RawReaders(path, stride, args.readers, args.batch, args.hugepages, args.thp)
    extra = ["--hugepages"] if args.hugepages else [] if args.thp else ["--no-thp"]
    daemons = {}
    try:
        for m in ("direct", "buffered"):
            daemons[m] = harness.Daemon(path, "--read-mode", m, "--slots", args.batch, *extra,
                                        readers=args.given_readers)
    except BaseException:
        for d in daemons.values():       # a daemon left running would keep its huge pages
            d.stop()
        raise
    runs = {"floor": [harness.physical_runs(os.getpid(), harness.address(v), stride) for v in raw.views],
            "direct": harness.arena_physical_runs(daemons["direct"].pid, stride, args.batch)}
    pages = ("hugetlb (--hugepages)" if args.hugepages else
             f"transparent huge pages (floor {100 * raw.arena.thp_bytes // raw.arena.mapped}% of its arena)"
             if args.thp else "4 KiB (--no-thp)")
    harness.banner("cold_read", f"pages: {pages}; memory compacted first: "
                                f"{'yes' if compacted else 'no (not root)'}; physical runs per slot "
                                "(fewer = more contiguous): " + "; ".join(f"{m} {r}" for m, r in runs.items()))
    clients = {m: k3client.connect(d.endpoint, name=f"cold-{m}") for m, d in daemons.items()}

    def one_batch(m: str, layer: int, experts: list[int]) -> float:
        harness.drop_page_cache(path)
        if m in ("direct", "buffered"):
            c = clients[m]
            c.begin_token()
            t0 = time.perf_counter()
            c.fetch(layer, experts)
            return time.perf_counter() - t0
        offs = [offset[(layer, e)] for e in experts]
        if m == "floor":
            return raw.floor(offs, args.request)
        if m == "floorcrc":
            return raw.floor_crc(offs, args.request, [crcs[(layer, e)] for e in experts])
        return raw.demand_paging(offs, args.readers * MMAPS[m] if m in MMAPS else 1)

    results = {p: {m: [] for m in METHODS} for p in patterns}   # GB/s per pass
    try:
        for rep in range(args.reps):
            for p in patterns:
                misses0 = {m: c.status()["stats"]["misses"] for m, c in clients.items()}
                seconds = dict.fromkeys(METHODS, 0.0)
                order_rng = random.Random(f"{args.seed}-{p}-{rep}")
                for layer, experts in batches(keys, args.batch, p, args.seed + rep):
                    # a fresh random order per batch: a method must not always follow the same
                    # other one (mmap's readahead can still be in flight when the next starts)
                    for m in order_rng.sample(METHODS, len(METHODS)):
                        seconds[m] += one_batch(m, layer, experts)
                for m, c in clients.items():
                    misses = c.status()["stats"]["misses"] - misses0[m]
                    if misses != len(keys):
                        raise SystemExit(f"k3d {m}: a {p} pass had {misses} misses of {len(keys)} keys")
                for m in METHODS:
                    results[p][m].append(total / seconds[m] / 1e9)
                harness.banner("cold_read", f"pass {rep + 1} {p:<6}: " + "  ".join(
                    f"{m} {results[p][m][-1]:.2f}" for m in METHODS) + " GB/s")
    finally:
        for c in clients.values():
            c.close()
        for d in daemons.values():
            d.stop()
        raw.close()

    verdicts = []
    for p in patterns:
        r = results[p]

        def ratio(a: str, b: str, r=r) -> float:
            return harness.median([x / y for x, y in zip(r[a], r[b])])

        best_mmap = [max(x) for x in zip(r["mmap"], r["mmap2x"], r["mmap1"])]
        print(f"\n{p}: {'method':<34}{'GB/s (median)':>14}{'x floor':>10}{'x fastest mmap':>16}")
        for m in METHODS:
            vs_mmap = harness.median([x / b for x, b in zip(r[m], best_mmap)])
            print(f"{'':<{len(p) + 2}}{LABELS[m].format(r=args.readers, r2=2 * args.readers):<34}"
                  f"{harness.median(r[m]):>14.2f}{ratio(m, 'floor'):>10.2f}{vs_mmap:>16.2f}")
        r_floor = ratio("direct", "floor")
        r_mmap = harness.median([d / b for d, b in zip(r["direct"], best_mmap)])
        ceiling = harness.median([f / b for f, b in zip(r["floor"], best_mmap)])
        print(f"{'':<{len(p) + 2}}floor / fastest mmap = {ceiling:.2f} (the most any reader can show)")
        print(f"{'':<{len(p) + 2}}direct / floorcrc = {ratio('direct', 'floorcrc'):.2f} (k3d's own cost beyond "
              f"read-time verification, which costs the floor {1 - ratio('floorcrc', 'floor'):.0%})")
        verdicts.append((p, "direct >= 0.9x floor", r_floor, r_floor >= 0.9))
        verdicts.append((p, "direct >= 2.5x fastest mmap", r_mmap, r_mmap >= 2.5))
    print("(ratios: medians over passes of per-pass ratios)\n")
    # The targets are about cold *misses*, which arrive in routing order; the file-order
    # scan is printed for what it shows (mmap's best case), not judged.
    for p, what, x, ok in sorted(verdicts, key=lambda v: v[0] == "routed"):    # targets last
        judged = p == "routed"
        print(f"{'target' if judged else 'info  '} {p:<6} {what:<28} {x:5.2f}x  "
              f"{harness.verdict(ok) if judged else '(file order: not the miss pattern)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
