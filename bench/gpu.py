"""GPU figures of the CUDA path, in one run of under 5 minutes, as ONE JSON line on stdout.

    python bench/gpu.py [--phases env,bandwidth,overlap] [--reps 5] [--cpu]

A synthetic checkpoint of gpt-oss-120b-sized experts (13.2 MB each, 2 layers x 16),
a real ``k3d start``, one client; every figure is measured against a floor in the
same run:

- ``env``: torch/CUDA versions, the device, device attribute 113 (read-only host
  registration), ``RLIMIT_MEMLOCK``;
- ``bandwidth``: host-to-device GB/s of every expert's slot span (median of
  ``--reps``) from the arena before registration (pageable), after it (registered
  through ``k3client.gpu.pinning``, as the runtime does: time per GiB, chunks), and
  from torch pinned buffers holding the same bytes (the floor): ``registered_vs_pinned``
  (target >= 0.8).  ``host_bytes_per_arena_byte``: the arena's bytes plus the host
  memory registration took (``MemAvailable`` before and after), per arena byte
  (target 1.0; a pinned copy of the arena, as vLLM's UVA offload keeps, is 2.0 by
  construction: its ``pinned_copy_bytes_per_arena_byte`` is measured the same way);
- ``overlap``: the share of the copy time hidden behind compute by the copy stream
  (``k3client.gpu.streams.Copier``): copies alone, a per-expert device workload
  alone (sized to take about as long), and both pipelined in groups of 4 as the
  runtime runs them: ``hidden = (copy + compute - both) / copy``.

Without CUDA it measures nothing and says so (``"measured": false``); ``--cpu``
runs the same plumbing (daemon, fetches, spans, copies to CPU tensors) to check
the script itself.  Exit 0 unless a phase raised.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
import torch  # noqa: E402

BUDGET_S = 280.0
T0 = time.monotonic()


def log(*a):
    print("[bench/gpu]", *a, file=sys.stderr, flush=True)


def meminfo(key: str = "MemAvailable") -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return -1


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gbps(srcs, device, reps: int) -> float:
    """Median GB/s of copying every tensor of ``srcs`` to ``device`` (non-blocking, then one sync)."""
    dsts = [torch.empty_like(s, device=device) for s in srcs]
    nbytes, times = sum(s.numel() for s in srcs), []
    for _ in range(reps + 1):                        # the first is a warm-up
        sync(device)
        t = time.perf_counter()
        for s, d in zip(srcs, dsts):
            d.copy_(s, non_blocking=True)
        sync(device)
        times.append(time.perf_counter() - t)
    return round(nbytes / statistics.median(times[1:]) / 1e9, 2)


def p_env(out: dict, device) -> None:
    out["torch"], out["torch_cuda"] = torch.__version__, torch.version.cuda
    out["rlimit_memlock"] = list(resource.getrlimit(resource.RLIMIT_MEMLOCK))
    out["cpu"] = harness_cpu()
    if device.type != "cuda":
        return
    from k3client.gpu.cuda import CudaApi

    p = torch.cuda.get_device_properties(device)
    out["device"], out["device_gib"] = p.name, round(p.total_memory / 2**30, 1)
    out["read_only_host_register_supported"] = CudaApi().read_only_supported(device.index)


def harness_cpu() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} CPUs"
    return f"{os.cpu_count()} CPUs"


def spans_of(c, exs) -> list:
    return [torch.frombuffer(c.arena, dtype=torch.uint8, count=c.expert_bytes, offset=ex.slot * c.slot_bytes)
            for ex in exs]


def p_bandwidth(out: dict, c, exs, device, reps: int) -> None:
    from k3client.hf.gpu import GpuSide

    spans = spans_of(c, exs)
    out["experts"], out["expert_bytes"], out["arena_bytes"] = len(spans), c.expert_bytes, len(c.arena)
    out["pageable_gbps"] = gbps(spans, device, reps)
    if device.type == "cuda":
        g = GpuSide(c)
        before = meminfo()
        t = time.perf_counter()
        g.use(c, [device])
        reg_s = time.perf_counter() - t
        taken = max(0, before - meminfo())
        reg = g.pinning.registered.get((id(c.arena), c.gen))
        out["registered"] = reg is not None
        if reg is not None:
            out["register_s_per_gib"] = round(reg_s / (len(c.arena) / 2**30), 3)
            out["chunks"] = len(reg.chunks)
            out["pinned"] = all(s.is_pinned() for s in spans[:2])
        out["host_bytes_per_arena_byte"] = round((len(c.arena) + taken) / len(c.arena), 3)
    out["registered_gbps"] = gbps(spans, device, reps)
    before = meminfo()
    pinned = [torch.empty(s.numel(), dtype=torch.uint8, pin_memory=device.type == "cuda") for s in spans]
    for p, s in zip(pinned, spans):
        p.copy_(s)
    copy_bytes = sum(p.numel() for p in pinned)
    out["pinned_copy_bytes_per_arena_byte"] = round(1 + max(0, before - meminfo()) / copy_bytes, 3)
    out["torch_pinned_gbps"] = gbps(pinned, device, reps)
    out["registered_vs_pinned"] = round(out["registered_gbps"] / out["torch_pinned_gbps"], 3)
    del pinned


def p_overlap(out: dict, c, exs, device, reps: int) -> None:
    """Copy stream vs compute stream (module docstring)."""
    if device.type != "cuda":
        out["skipped"] = "needs CUDA"
        return
    from k3client.gpu.streams import Copier

    spans = spans_of(c, exs)
    a = torch.randn(2048, 2048, device=device, dtype=torch.float16)

    def work(n):
        for _ in range(n):
            torch.mm(a, a)

    def timed(fn):
        ts = []
        for _ in range(reps + 1):
            sync(device)
            t = time.perf_counter()
            fn()
            sync(device)
            ts.append(time.perf_counter() - t)
        return statistics.median(ts[1:])

    copier = Copier()
    groups = [list(enumerate(spans[i:i + 4], i)) for i in range(0, len(spans), 4)]

    def copies_only():
        for gr in groups:
            for _ in copier.stage([(e, (s,)) for e, s in gr], device):
                pass

    t_copy = timed(copies_only)
    one_mm = timed(lambda: work(10)) / 10
    n = max(1, round(t_copy / len(spans) / max(one_mm, 1e-9)))   # per expert: about its copy's time
    t_compute = timed(lambda: work(n * len(spans)))

    def both():
        for gr in groups:
            for _ in copier.stage([(e, (s,)) for e, s in gr], device):
                work(n)

    t_both = timed(both)
    out.update(copy_s=round(t_copy, 4), compute_s=round(t_compute, 4), both_s=round(t_both, 4),
               mm_per_expert=n, hidden=round(max(0.0, min(1.0, (t_copy + t_compute - t_both) / t_copy)), 3))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--phases", default="env,bandwidth,overlap")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cpu", action="store_true", help="check the plumbing without CUDA (copies to CPU tensors)")
    args = ap.parse_args()
    phases = args.phases.split(",")
    cuda = torch.cuda.is_available()
    res = {"bench": "gpu", "measured": cuda, "cuda": cuda}
    if not cuda and not args.cpu:
        res["note"] = "no CUDA device: nothing measured (run on a GPU host; --cpu checks the script)"
        print(json.dumps(res))
        return 0
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    failed = False
    ckpt = harness.checkpoint(layers=2, experts=16, hidden=2880, inter=2880, seed=3)
    try:
        import k3client

        with harness.Daemon(ckpt, "--slots", "32") as d:
            c = k3client.connect(d.endpoint, name="bench-gpu")
            try:
                exs = c.fetch(0, list(range(16))) + c.fetch(1, list(range(16)))
                for name, fn in (("env", p_env), ("bandwidth", p_bandwidth), ("overlap", p_overlap)):
                    if name not in phases:
                        continue
                    if time.monotonic() - T0 > BUDGET_S:
                        res[name] = {"skipped": "time budget"}
                        continue
                    out, t = {}, time.monotonic()
                    log(f"phase {name} ...")
                    try:
                        fn(out, device) if name == "env" else fn(out, c, exs, device, args.reps)
                    except Exception as e:  # recorded; the next phase runs
                        failed = True
                        out["error"] = f"{type(e).__name__}: {e}"
                        out["trace"] = traceback.format_exc()[-1500:]
                    out["seconds"] = round(time.monotonic() - t, 2)
                    res[name] = out
                del exs
            finally:
                c.close()
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    res["seconds"] = round(time.monotonic() - T0, 1)
    print(json.dumps(res))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
