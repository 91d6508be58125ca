"""A vLLM decode step's per-layer cost in the plugin's runtime, against the bare kernel calls, in one run.

    python bench/layer_cost.py [--hidden 512] [--inter 1024] [--layers 4] [--tp 2] [--rank 0]
                               [--batch 1 4] [--steps 200] [--reps 5] [--dtype bfloat16|float32] [--profile]

The tiny Qwen3-MoE of ``bench/vllm_overhead.py`` (``k3d.demo.vllm_models``), a real
``k3d start`` holding every expert, and one client that is ``--rank`` of ``--tp``
tensor-parallel ranks (its shard of each expert, ``k3client.vllm.ranks.Shard``) on one
torch thread, as a vLLM rank pinned to one core runs.  No vLLM engine: the runtime
(``k3client.runtime.Runtime``, vLLM's fused numerics, the native kernels) is driven
as vLLM's ``apply`` drives it, one ``begin_forward`` and every MoE layer's
``run_layer`` per step, with random routing (``B`` tokens, top-k each, a fixed seed)
and random hidden states.  Each step's ``begin_token`` reply is read before its
layers are timed (in vLLM it arrives while the engine samples).  Per batch size and path, the median over ``--reps`` of
the time per MoE layer:

- ``floor``: the bare kernel calls of the same steps over views fetched once
  (``native.rowmm`` for each routed expert's gate, up and down shard, on its rows
  gathered beforehand, gate times up in place; no activation, fetch, scaling or sum);
- ``per expert``: the runtime with one ``native.gated_expert`` call per expert
  (``Runtime.native_layer`` None: the path before the one-call kernel);
- ``one call``: the runtime with ``native.layer_experts`` (one call per layer).

Each is printed in µs per layer and as a ratio to the floor; the paths alternate
within every rep, so they see the same machine load.  ``--profile`` prints a
cProfile of each runtime path (its own run, after the timing).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402

import k3client  # noqa: E402
from k3d.demo import vllm_models  # noqa: E402


def build(client, cfg, a):
    import torch

    from k3client.runtime import Activation, Layer, Runtime, Standard
    from k3client.vllm import native, ranks

    rowmm, one = native.load(), native.load_layer()
    if rowmm is None or one is None:
        sys.exit("layer_cost: the native kernel is unavailable here (no AVX-512 or no compiler)")
    dtype = getattr(torch, a.dtype)
    shard = ranks.Shard(a.rank, a.tp) if a.tp > 1 else None
    layers = {}
    for i in range(a.layers):
        specs = client.layout_of(i)
        fam = Standard({s.name for s in specs})
        # a router, as vLLM's layer has: with every expert resident gate-ahead only checks the index
        router = torch.nn.Linear(a.hidden, cfg["num_local_experts"], bias=False).to(dtype)
        layers[i] = Layer(i, Activation(cfg["num_local_experts"], "silu"), router, fam, tuple(s.name for s in specs),
                          dtype, top_k=cfg["num_experts_per_tok"], specs=specs,
                          rowmajor=native.eligible(specs, fam, a.tp), shard=shard)
    rt = Runtime(client, layers, predict=True, numerics="fused",
                 native=functools.partial(native.gated_expert, rowmm),
                 native_layer=functools.partial(native.layer_experts, one), skip_resident=True)
    return rt, rowmm, one


def steps(cfg, a, batch: int, dtype):
    """``a.steps`` steps of per-layer (hidden states, top-k ids, top-k weights), seeded."""
    import torch

    g = torch.Generator().manual_seed(batch)
    e, k = cfg["num_local_experts"], cfg["num_experts_per_tok"]
    out = []
    for _ in range(a.steps):
        per = []
        for _ in range(a.layers):
            x = torch.randn(batch, a.hidden, generator=g).to(dtype)
            idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(batch)])
            w = torch.softmax(torch.randn(batch, k, generator=g), dim=-1)
            per.append((x, idx, w))
        out.append(per)
    return out


def run_runtime(rt, work) -> float:
    """Seconds per MoE layer of ``work`` through the runtime.  Each step's ``begin_token`` reply is
    read before its timed layers: in vLLM it comes back while the engine samples and schedules."""
    layers = [rt.layers[i] for i in sorted(rt.layers)]
    total = 0.0
    for per in work:
        rt.begin_forward()
        rt.client.settle()
        t0 = time.perf_counter()
        for ml, (x, idx, w) in zip(layers, per):
            rt.run_layer(ml, x, idx, w)
        total += time.perf_counter() - t0
    return total / (len(work) * len(layers))


def floor_calls(rt, views, work):
    """Per step, per layer, the routed experts' ``(rows, gate, up, down)``: the floor's inputs."""
    layers = sorted(rt.layers)
    out = []
    for per in work:
        step = []
        for layer, (x, idx, _) in zip(layers, per):
            xf, ids, k = x.float(), idx.reshape(-1).tolist(), idx.shape[1]
            step.append([(xf[[i // k for i, j in enumerate(ids) if j == e]], *views[layer][e])
                         for e in sorted(set(ids))])
        out.append(step)
    return out


def run_floor(rowmm, calls) -> float:
    """Seconds per MoE layer of the bare ``rowmm`` calls (``floor_calls``)."""
    t0 = time.perf_counter()
    for step in calls:
        for layer in step:
            for xe, gate, up, down in layer:
                rowmm(rowmm(xe, gate).mul_(rowmm(xe, up)), down)
    return (time.perf_counter() - t0) / (len(calls) * len(calls[0]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--inter", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    import torch

    from k3client import cpu

    torch.set_num_threads(1)                # a vLLM rank pinned to one core
    tmp = tempfile.mkdtemp(prefix="k3d-lc-")
    rows = []
    try:
        path = vllm_models.write("qwen3_moe", os.path.join(tmp, "m"), hidden=a.hidden, inter=a.inter,
                                 layers=a.layers)
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        with harness.Daemon(path) as d, k3client.connect(d.endpoint, name="layer-cost") as client:
            rt, rowmm, one = build(client, cfg, a)
            views = {}
            client.begin_token()
            for i in range(a.layers):             # every expert read once (then resident), its views
                ml = rt.layers[i]
                got = client.fetch(i, list(range(cfg["num_local_experts"])))
                # (gate, up, down) of each expert (its shard on a TP rank)
                views[i] = [v if len(v) == 3 else (*v[0].chunk(2), v[1]) for v in (rt._views(ml, ex) for ex in got)]
            dtype = getattr(torch, a.dtype)
            for b in a.batch:
                work = steps(cfg, a, b, dtype)
                calls = floor_calls(rt, views, work)
                run_runtime(rt, work[:20])
                fl, per, onec = [], [], []
                for _ in range(a.reps):
                    fl.append(run_floor(rowmm, calls))
                    keep, rt.native_layer = rt.native_layer, None
                    per.append(run_runtime(rt, work))
                    rt.native_layer = keep
                    onec.append(run_runtime(rt, work))
                rows.append((b, statistics.median(fl), statistics.median(per), statistics.median(onec)))
                if a.profile:
                    for name in ("per expert", "one call"):
                        keep = rt.native_layer
                        if name == "per expert":
                            rt.native_layer = None
                        prof = cProfile.Profile()
                        prof.enable()
                        run_runtime(rt, work)
                        prof.disable()
                        rt.native_layer = keep
                        print(f"--- cProfile, batch {b}, {name} ({a.steps} steps x {a.layers} layers) ---")
                        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    harness.banner("layer_cost", f"qwen3_moe hidden {a.hidden} inter {a.inter}, {a.layers} layers, top-"
                   f"{cfg['num_experts_per_tok']} of {cfg['num_local_experts']}; rank {a.rank} of TP {a.tp}, "
                   f"{a.dtype}, one torch thread; {a.steps} steps x {a.reps} reps, medians")
    facts = cpu.facts()
    print(f"  CPU: {cpu.model_name()}, {facts.describe()}, {os.cpu_count()} cores; load average "
          f"{os.getloadavg()[0]:.2f}")
    for b, fl, per, onec in rows:
        print(f"  batch {b}: floor {1e6 * fl:6.1f} us/layer   per expert {1e6 * per:6.1f} ({per / fl:.2f}x)   "
              f"one call {1e6 * onec:6.1f} ({onec / fl:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
