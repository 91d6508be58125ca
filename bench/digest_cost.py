"""The content digest's start-up cost: bytes read per GB of checkpoint, seconds cold, 100 GB extrapolated.

    python bench/digest_cost.py [--gb 1] [--reps 3]

Why: ``k3d start`` computes the content digest (``k3client.digest``'s rule: up
to 8 x 4 KiB per expert tensor) from its source before it is ready, unless the
state directory holds it for the same files.  This bench states what that
costs, against the disk's floor measured in the same run.

Measured, on a safetensors checkpoint of ``--gb`` GB written here (Qwen3-30B-A3B
expert tensors: bf16 [768, 2048] and [2048, 768], 3 MiB each):
- floor: the whole checkpoint read sequentially (8 MiB preads), the page cache
  dropped first: the disk's read rate (GB/s);
- digest cold: ``k3d.sources.digest.compute`` with the daemon's thread count
  (``threads_for``; ``--threads`` to try others), the page cache dropped first (the
  digest drops the pages it sampled, so every run is cold); cached:
  ``for_source`` with the digest in the state directory (a restart);
- client verify cold: ``k3client.local_experts.digest`` (what ``Client.verify`` and
  the loaders run on the local checkpoint), the page cache dropped first;
- reps alternate floor, digest and client (drift hits all); medians printed.

Printed: bytes the rule reads per GB for this checkpoint and for the tensor sizes
of some shipped models (computed from the rule, no I/O); the digest's cold seconds
as a ratio of the sequential full read (the floor); seconds for 100 GB, scaled
from the measured time by tensor count (the rule's reads are per tensor), and the
100 GB full read at the floor for comparison.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))

from k3client.digest import sampled_bytes  # noqa: E402
from k3client.local_experts import THREADS as LOCAL_THREADS, digest as local_digest  # noqa: E402
from k3d.reads.plan import readers_for  # noqa: E402
from k3d.sources import open_source  # noqa: E402
from k3d.sources.digest import compute, for_source, threads_for  # noqa: E402

GB = 1e9
SHAPE = (768, 2048)                        # Qwen3-30B-A3B's expert tensors (gate/up; down is the transpose)
# per expert tensor bytes of some shipped checkpoints (name: [(bytes, tensors per expert)])
MODELS = {
    "Qwen3-30B-A3B bf16": [(768 * 2048 * 2, 3)],
    "Mixtral-8x7B bf16": [(14336 * 4096 * 2, 3)],
    "DeepSeek-V3 fp8 (+scale_inv)": [(2048 * 7168, 3), (16 * 56 * 4, 3)],
    "gpt-oss-120b MXFP4 (blocks+scales)": [(5760 * 2880 // 2, 1), (5760 * 90, 1), (2880 * 2880 // 2, 1),
                                           (2880 * 90, 1)],
}


def write(path: str, gb: float) -> str:
    """Safetensors shards of ~``gb`` GB of experts (random bytes), 1 GB a shard."""
    from safetensors.numpy import save_file

    os.makedirs(path)
    per = SHAPE[0] * SHAPE[1] * 2
    experts_total = max(1, int(gb * GB / (3 * per)))
    per_layer = 32
    layers = -(-experts_total // per_layer)
    rng = np.random.default_rng(0)
    shard, tensors, size = 0, {}, 0
    for layer in range(layers):
        for e in range(per_layer):
            for name, shape in (("gate_proj", SHAPE), ("up_proj", SHAPE), ("down_proj", SHAPE[::-1])):
                tensors[f"model.layers.{layer}.mlp.experts.{e}.{name}.weight"] = \
                    rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
                size += per
            if size >= GB:
                save_file(tensors, os.path.join(path, f"model-{shard:05d}.safetensors"))
                shard, tensors, size = shard + 1, {}, 0
    if tensors:
        save_file(tensors, os.path.join(path, f"model-{shard:05d}.safetensors"))
    return path


def drop_cache(files) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sequential(files) -> tuple[float, int]:
    """Seconds and bytes of reading every file start to end (8 MiB preads)."""
    buf = bytearray(8 << 20)
    total, t0 = 0, time.perf_counter()
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            off = 0
            while True:
                n = os.preadv(fd, [buf], off)
                if n <= 0:
                    break
                off += n
            total += off
        finally:
            os.close(fd)
    return time.perf_counter() - t0, total


def rule_table() -> None:
    print("bytes the rule reads per GB of expert tensors (computed from the rule):")
    for name, tensors in MODELS.items():
        read = sum(sampled_bytes(b) * k for b, k in tensors)
        size = sum(b * k for b, k in tensors)
        print(f"  {name:36s} {read / size * GB / 1e6:8.2f} MB per GB ({100 * read / size:.3f} %)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=1.0, help="checkpoint size to write (GB)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="digest threads (0: the daemon's reader count)")
    args = ap.parse_args()
    rule_table()
    d = tempfile.mkdtemp(prefix="k3d-digest-", dir=os.environ.get("K3D_BENCH_DIR") or "/var/tmp")
    try:
        path = write(os.path.join(d, "ck"), args.gb)
        src = open_source(path, "")
        try:
            files = list(src.files)
            threads = args.threads or threads_for(src, readers_for(src.kind, os.cpu_count()))
            size = sum(s.nbytes for k in src.keys for s in src.layout_of(k[0]))
            tensors = sum(len(src.layout_of(k[0])) for k in src.keys)
            floor, cold, client, nread = [], [], [], 0
            model = src.describe()
            for _ in range(args.reps):
                drop_cache(files)
                secs, total = sequential(files)
                floor.append(total / secs)
                drop_cache(files)
                t0 = time.perf_counter()
                _, nread = compute(src, threads)
                cold.append(time.perf_counter() - t0)
                drop_cache(files)
                t0 = time.perf_counter()
                local_digest(path, model, src.layout_of)
                client.append(time.perf_counter() - t0)
            state = os.path.join(d, "state")
            for_source(src, state, threads)
            t0 = time.perf_counter()
            assert for_source(src, state, threads)["cached"]
            cached = time.perf_counter() - t0
        finally:
            src.close()
        bps, c, v = statistics.median(floor), statistics.median(cold), statistics.median(client)
        full = size / bps
        print(f"\ncheckpoint: {size / GB:.2f} GB of experts, {tensors} expert tensors, {len(files)} files; "
              f"{threads} digest threads; {os.cpu_count()} CPUs; medians of {args.reps}")
        print(f"  rule reads        {nread / 1e6:.2f} MB = {nread / size * GB / 1e6:.2f} MB per GB "
              f"({100 * nread / size:.3f} %)")
        print(f"  floor             {bps / GB:.2f} GB/s sequential, cold: {full:.2f} s for the whole checkpoint")
        print(f"  digest cold       {c:.3f} s = {c / full:.3f} x the full read at the floor")
        print(f"  client verify     {v:.3f} s cold = {v / full:.3f} x the full read (k3client.local_experts, "
              f"{LOCAL_THREADS} threads)")
        print(f"  digest cached     {cached * 1e3:.1f} ms (restart on the same files: the state directory)")
        scale = 100 * GB / size
        print(f"  100 GB, cold      digest ~{c * scale:.1f} s, client verify ~{v * scale:.1f} s (scaled by tensor "
              f"count), vs {100 * GB / bps:.1f} s to read 100 GB at the floor; rule reads {nread * scale / 1e6:.0f} MB")
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
