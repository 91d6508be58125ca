"""Miss path: a batch of misses from a page-cache-resident checkpoint into the arena.

    python bench/miss_path.py [--batch 8] [--readers N] [--reps 5] [--rounds 8]
                              [--stream cycle|alternate] [--predict default|client|both]

Runs the daemon's default reader count unless ``--readers`` is given, and its
default ``--predict`` (the daemon's own predictor) unless ``--predict`` says
otherwise; ``both``: a default daemon and a ``--predict client`` one side by side,
fetch for fetch in the same rounds, with their ratio (target: the default
>= 0.95x ``client``: the daemon's predictor never costs demand throughput).

Streams (``--stream``):

- ``cycle`` (the default): as below, 3 layers x ``batch`` experts, ``batch`` slots.
- ``alternate``: a small arena on larger experts: 16 slots (``--slots``) of
  17.6 MB experts (hidden 2880, inter 3840), one fetch of ``batch`` experts per
  token, alternating between 2 layers, each layer's experts rotating over
  ``slots // batch + 1`` sets of ``batch`` (3 sets, 24 experts per layer at batch
  8), so that every key misses (the arena holds fewer fetches than the rotation)
  while the two layers alternate as a predictor might hope to exploit.  At
  ``--batch 4`` the arena has room to read ahead beside a token's pins.

Checkpoint: gpt-oss-shaped MXFP4 experts (hidden 2880, inter 2880: w1/w3/w2
packed nibbles + E8M0 scales, 13.2 MB per expert), 3 layers x ``batch``
experts, read once before measuring so every byte is in the page cache.

Measured: ``begin_token()`` then ``fetch(layer, batch experts)``, cycling over
the layers with an arena of exactly ``batch`` slots, so every key of every
fetch is a miss (the previous layer's slots are evicted); GB/s = batch bytes /
fetch latency.  Floor, same run: ``readers`` persistent Python threads doing
one ``os.preadv`` per expert (the same file spans; experts cut in parts when
there are fewer than threads) into pre-touched shared
memory (a memfd of ``batch`` slots, like the arena), timed from hand-out to
the last completion.  Daemon and floor alternate round by round; each rep's
figure is the median of its rounds; the result is the median over reps (the
ratio: the median of the per-rep ratios).

Target: daemon >= 0.8x the floor.
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import queue
import shutil
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402

from k3d.reads.plan import parts_per_key, readers_for, split_extents  # noqa: E402
from k3d.sources import Extent, Source  # noqa: E402

HIDDEN = INTER = 2880
LAYERS = 3
TARGET = 0.8
TARGET_PREDICT = 0.95       # the default against --predict client
STREAMS = {   # name: (layers, expert sets per layer (None: slots // batch + 1), hidden, inter, slots (None: batch))
    "cycle": (LAYERS, 1, HIDDEN, INTER, None),
    "alternate": (2, None, 2880, 3840, 16),
}
PAGE = 4096


class PreadvPool:
    """The floor: ``threads`` persistent threads, one ``os.preadv`` per expert span."""

    def __init__(self, path: str, threads: int, slots: int, slot_bytes: int):
        self.fd = os.open(path, os.O_RDONLY)
        self.slot_bytes = slot_bytes
        self.memfd = os.memfd_create("bench-floor", os.MFD_CLOEXEC)
        os.ftruncate(self.memfd, slots * slot_bytes)
        self.mm = mmap.mmap(self.memfd, slots * slot_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        view = memoryview(self.mm)
        for off in range(0, len(self.mm), PAGE):   # pre-touch every page
            view[off] = 1
        self.view = view
        self.bytes, self.seconds = 0, 0.0       # summed over threads, like k3d's read_seconds
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        for t in self.threads:
            t.start()

    def _run(self):
        while True:
            job = self.jobs.get()
            if job is None:
                return
            slot, at, off, n = job
            base = slot * self.slot_bytes + at
            dest = self.view[base: base + n]
            t = time.perf_counter()
            got = 0
            while got < n:
                got += os.preadv(self.fd, [dest[got:]], off + got)
            self.done.put((got, time.perf_counter() - t))

    def batch(self, spans) -> float:
        """Read ``spans`` [(file_offset, nbytes)] into slots 0..; returns seconds.
        With fewer experts than threads, each is cut into page-aligned parts so
        that every thread has work (the daemon does the same)."""
        parts = parts_per_key(len(self.threads), len(spans), Source.max_parts)   # as the server does
        jobs = [(slot, e.slot_offset, e.offset, e.length) for slot, (off, n) in enumerate(spans)
                for group in split_extents([Extent(0, off, 0, n)], parts) for e in group]
        t0 = time.perf_counter()
        for j in jobs:
            self.jobs.put(j)
        for _ in jobs:
            got, secs = self.done.get()
            self.bytes += got
            self.seconds += secs
        return time.perf_counter() - t0

    def close(self):
        for _ in self.threads:
            self.jobs.put(None)
        for t in self.threads:
            t.join()
        self.view.release()
        self.mm.close()
        os.close(self.memfd)
        os.close(self.fd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8, help="misses per fetch (experts per layer)")
    ap.add_argument("--readers", type=int, default=None,
                    help="daemon reader threads = floor threads (default: the daemon's own choice for "
                         "safetensors, k3d.reads.plan.readers_for)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=8, help="fetches (and floor batches) per rep")
    ap.add_argument("--stream", choices=sorted(STREAMS), default="cycle")
    ap.add_argument("--slots", type=int, default=None, help="arena slots (default: the stream's)")
    ap.add_argument("--predict", choices=("default", "client", "both"), default="default",
                    help="the daemon's --predict: its default, client, or both side by side")
    a = ap.parse_args()
    given = a.readers
    a.readers = a.readers or readers_for("safetensors", os.cpu_count())
    layers, sets, hidden, inter, slots = STREAMS[a.stream]
    slots = a.slots or slots or a.batch
    sets = sets or slots // a.batch + 1
    modes = ("default", "client") if a.predict == "both" else (a.predict,)

    import k3client

    t0 = time.perf_counter()
    ckpt = harness.checkpoint(layers=layers, experts=sets * a.batch, hidden=hidden, inter=inter, seed=2)
    path = os.path.join(ckpt, "model.safetensors")
    size = os.path.getsize(path)
    spans = harness.safetensors_experts(path)
    expert_bytes = next(iter(spans.values()))[1]
    slot_bytes = -(-expert_bytes // PAGE) * PAGE
    warm = min(harness.warm_page_cache(path) for _ in range(2))
    harness.banner("miss_path", f"stream {a.stream}: checkpoint {size / 1e6:.0f} MB ({layers} layers x "
                   f"{sets * a.batch} experts of {expert_bytes / 1e6:.1f} MB), {slots} slots, written in "
                   f"{time.perf_counter() - t0:.1f}s; page-cache read {size / warm / 1e9:.1f} GB/s")
    batch_bytes = a.batch * expert_bytes
    floor = PreadvPool(path, a.readers, a.batch, slot_bytes)
    fetch_gbs: dict[str, list[float]] = {m: [] for m in modes}
    floor_gbs: list[float] = []
    ratios: dict[str, list[float]] = {m: [] for m in modes}
    vs_client: list[float] = []
    n = 0

    def key_set(i: int) -> tuple[int, list[int]]:
        """Fetch ``i``'s layer and experts: layers in turn, each layer's sets in turn."""
        layer = i % layers
        first = (i // layers) % sets * a.batch
        return layer, list(range(first, first + a.batch))

    try:
        with contextlib.ExitStack() as stack:
            clients = {}
            for mode in modes:
                extra = ("--predict", "client") if mode == "client" else ()
                d = stack.enter_context(harness.Daemon(ckpt, "--slots", slots, *extra, readers=given))
                clients[mode] = stack.enter_context(k3client.connect(d.endpoint, name=f"bench-miss-{mode}"))

            def one_fetch(c) -> float:
                layer, experts = key_set(n)
                c.begin_token()
                t = time.perf_counter()
                c.fetch(layer, experts)
                return time.perf_counter() - t

            def one_floor() -> float:
                layer, experts = key_set(n)
                return floor.batch([spans[(layer, e)] for e in experts])

            for _ in range(layers * sets):    # warm-up: every slot written once
                for c in clients.values():
                    one_fetch(c)
                one_floor()
                n += 1
            st0 = {m: c.status()["stats"] for m, c in clients.items()}
            floor.bytes, floor.seconds = 0, 0.0
            for r in range(a.reps):
                f: dict[str, list[float]] = {m: [] for m in modes}
                g = []
                for k in range(a.rounds):
                    # the modes' order alternates round by round: drift hits both
                    for m in (modes if (r * a.rounds + k) % 2 == 0 else modes[::-1]):
                        f[m].append(one_fetch(clients[m]))
                    g.append(one_floor())
                    n += 1
                floor_gbs.append(batch_bytes / harness.median(g) / 1e9)
                line = []
                for m in modes:
                    fetch_gbs[m].append(batch_bytes / harness.median(f[m]) / 1e9)
                    ratios[m].append(fetch_gbs[m][-1] / floor_gbs[-1])
                    line.append(f"{m} {fetch_gbs[m][-1]:.2f} GB/s ({harness.median(f[m]) * 1e3:.1f} ms/batch, "
                                f"ratio {ratios[m][-1]:.2f})")
                if len(modes) == 2:
                    vs_client.append(fetch_gbs["default"][-1] / fetch_gbs["client"][-1])
                    line.append(f"default/client {vs_client[-1]:.2f}")
                harness.banner("miss_path", f"rep {r + 1}/{a.reps}: " + " | ".join(line) +
                               f" | preadv floor {floor_gbs[-1]:.2f} GB/s ({harness.median(g) * 1e3:.1f} ms/batch)")
            status = {m: c.status() for m, c in clients.items()}
        fetched = a.reps * a.rounds * a.batch
        busy = {}
        for m in modes:
            st1 = status[m]["stats"]
            read_s = st1.get("read_seconds", 0) - st0[m].get("read_seconds", 0)
            busy[m] = (st1["bytes_read"] - st0[m]["bytes_read"]) / max(1e-9, read_s)
            misses = st1["misses"] - st0[m]["misses"]
            if m == "client":     # (the default's predictions may turn misses into hits: its time counts)
                assert misses == fetched, f"{m}: only {misses} of {fetched} fetched keys missed"
            elif misses != fetched:
                harness.banner("miss_path", f"{m}: {misses} of {fetched} fetched keys missed (the rest "
                               f"were its predictions' hits)")
            dp = status[m].get("prediction", {}).get("daemon")
            if dp:
                harness.banner("miss_path", f"{m}: daemon predictions issued {dp['issued']}, used {dp['used']}, "
                               f"skip {dp.get('skip', '-')}, read for nothing {dp['unused_bytes'] / 1e6:.0f} MB")
    finally:
        floor.close()
        shutil.rmtree(ckpt, ignore_errors=True)

    harness.banner("miss_path", "per-thread read speed while reading: " +
                   ", ".join(f"{m} daemon readers {busy[m] / 1e9:.2f} GB/s" for m in modes) +
                   f", floor threads {floor.bytes / floor.seconds / 1e9:.2f} GB/s")
    print(f"miss_path: stream {a.stream}, batches of {a.batch} misses x {expert_bytes / 1e6:.1f} MB, {slots} slots, "
          f"{a.readers} readers, {a.reps} reps x {a.rounds} rounds; medians (ratio: median of per-rep ratios)")
    fl = harness.median(floor_gbs)
    for m in modes:
        # per-rep ratios follow the VM's drifting speed better than a ratio of medians
        ratio = harness.median(ratios[m])
        print(f"miss_path: --predict {m}: {harness.median(fetch_gbs[m]):.2f} GB/s preadv_floor {fl:.2f} GB/s "
              f"ratio {ratio:.2f} (target >= {TARGET}) {harness.verdict(ratio >= TARGET)}")
    if vs_client:
        ratio = harness.median(vs_client)
        print(f"miss_path: default / --predict client {ratio:.2f} (target >= {TARGET_PREDICT}) "
              f"{harness.verdict(ratio >= TARGET_PREDICT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
