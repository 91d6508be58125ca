"""Answers as experts become ready: time per decode token, whole fetches against ``fetch_iter``.

    python bench/as_ready.py [--size small|gptoss] [--layers N] [--experts N] [--topk K]
                             [--share 0.3] [--tokens 2] [--reps 40] [--check] [--verbose]
                             [--no-predict]

Checkpoint: float32 SwiGLU experts (w1, w3: inter x hidden; w2: hidden x inter)
in one safetensors file, page-cache resident (read once before measuring):
``small`` is hidden 256 x inter 128 (0.39 MB per expert; 8 layers x 64 experts,
top-8), ``gptoss`` hidden 1024 x inter 1080 (13.3 MB per expert, gpt-oss's
expert size; 4 layers x 32 experts, top-4).  A real ``k3d start`` at its defaults
with an arena of ``--share`` of all experts; one client decodes single tokens
routed by ``k3d.demo.routing.SyntheticRouter``, with the gate-ahead guess of the
next layer sent as ``predicted=`` with each layer's fetch (as ``k3client.hf``
does); ``--no-predict``: none, and the daemon's own predictor off, so every
miss is read while the layer waits.

Per layer each mode computes the layer's experts on one token vector
(``silu(x w1^T) * (x w3^T) w2^T``, times its routing weight) from the arena views
and sums the outputs in ascending expert order:
- ``whole`` (before): ``fetch``, every expert in the arena, then compute in order;
- ``as_ready`` (after): ``fetch_iter``, each expert computed as it arrives, the
  outputs added in ascending order as soon as every one before is in.
``--check`` recomputes every layer in order from the same views after the token
and exits 1 unless the outputs are equal (``torch.equal``); the warm-up blocks
are always checked.  Floor, same run: ``whole``'s compute time alone (after its
fetches, from the same arena views), what a token would cost if no read were
ever waited for.  Modes alternate in short blocks (``--tokens`` each, after a
warm-up block of 8 tokens of each, so the cache is in its steady state), so the
VM's drift hits both; reported: the median over reps of each block's median ms
per token, their ratio to the floor, and as_ready / whole (the median of the
per-rep ratios; ``--verbose`` prints each rep).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import k3client  # noqa: E402
from k3d.demo.routing import SyntheticRouter  # noqa: E402

SIZES = {"small": dict(hidden=256, inter=128, layers=8, experts=64, topk=8),
         "gptoss": dict(hidden=1024, inter=1080, layers=4, experts=32, topk=4)}
NAMES = ("w1.weight", "w3.weight", "w2.weight")
PATTERN = "model.layers.{layer}.mlp.experts.{expert}.{name}"


def write_checkpoint(layers, experts, hidden, inter) -> str:
    """A float32 checkpoint in a fresh temp dir (the caller removes it)."""
    import tempfile

    from safetensors.numpy import save_file

    rng = np.random.default_rng(3)
    path = tempfile.mkdtemp(prefix="k3d-bench-ckpt-", dir="/tmp")
    tensors = {}
    for layer in range(layers):
        for e in range(experts):
            ws = {n: (rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[1])))
                  for n, shape in zip(NAMES, ((inter, hidden), (inter, hidden), (hidden, inter)))}
            tensors.update({PATTERN.format(layer=layer, expert=e, name=n): w for n, w in ws.items()})
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return path


def expert_out(w, x, gate):
    """One expert on token ``x``: SwiGLU, times its routing weight."""
    return (F.silu(x @ w["w1.weight"].T) * (x @ w["w3.weight"].T)) @ w["w2.weight"].T * gate


def tensors_of(ex):
    return {n: ex.tensor(n) for n in NAMES}


def layer_whole(c, layer, experts, predicted, x, gates, compute):
    exs = c.fetch(layer, experts, predicted=predicted)
    t0 = time.perf_counter()
    out = torch.zeros_like(x)
    for ex, g in zip(exs, gates):
        out += expert_out(tensors_of(ex), x, g)
    compute.append(time.perf_counter() - t0)
    return out, exs


def layer_as_ready(c, layer, experts, predicted, x, gates, compute):
    got, nxt, out, exs = {}, 0, torch.zeros_like(x), [None] * len(experts)
    for i, ex in c.fetch_iter(layer, experts, predicted=predicted):
        exs[i] = ex
        got[i] = expert_out(tensors_of(ex), x, gates[i])
        while nxt in got:                      # ascending order, whatever the arrival order
            out += got.pop(nxt)
            nxt += 1
    return out, exs


def token_inputs(router, hidden, rng):
    route, predicted = router.token()
    xs = [torch.from_numpy(rng.standard_normal(hidden).astype(np.float32) * 0.05) for _ in route]
    return [sorted(r) for r in route], predicted, xs


def run_block(c, mode, router, rng, n, hidden, check: bool, predict: bool = True) -> tuple[list[float], list[float]]:
    """Per token: its time, and (whole) the part of it spent computing after the fetches."""
    fn = layer_whole if mode == "whole" else layer_as_ready
    times, computed = [], []
    for _ in range(n):
        compute = []
        route, predicted, xs = token_inputs(router, hidden, rng)
        gates = [torch.full((), 1.0 / len(r)) for r in route]
        t0 = time.perf_counter()
        c.begin_token()
        outs = []
        for layer, experts in enumerate(route):
            pred = [(layer + 1, e) for e in predicted[layer]] if predict else None
            outs.append(fn(c, layer, experts, pred, xs[layer], [gates[layer]] * len(experts), compute))
        times.append(time.perf_counter() - t0)
        computed.append(sum(compute))
        if check:      # the same views, in order, after the fact (still pinned: same token)
            for (out, exs), x, g in zip(outs, xs, gates):
                want = torch.zeros_like(x)
                for ex in exs:
                    want += expert_out(tensors_of(ex), x, g)
                if not torch.equal(out, want):
                    raise SystemExit(f"{mode}: a layer's output differs from the in-order sum")
    return times, computed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--experts", type=int)
    ap.add_argument("--topk", type=int)
    ap.add_argument("--share", type=float, default=0.3)
    ap.add_argument("--tokens", type=int, default=2)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--check", action="store_true", help="check every token's outputs (slower)")
    ap.add_argument("--verbose", action="store_true", help="print each rep's figures")
    ap.add_argument("--no-predict", action="store_true",
                    help="no gate-ahead predictions, and the daemon's own off (--predict off): every miss waited for")
    a = ap.parse_args()
    shape = dict(SIZES[a.size])
    for k in ("layers", "experts", "topk"):
        if getattr(a, k):
            shape[k] = getattr(a, k)
    torch.set_num_threads(1)
    harness.banner("as_ready", f"{a.size}: {shape}, arena {a.share:.0%} of the experts; "
                   f"CPU: {os.cpu_count()} cores ({harness_cpu()})")
    path = write_checkpoint(shape["layers"], shape["experts"], shape["hidden"], shape["inter"])
    try:
        harness.warm_page_cache(os.path.join(path, "model.safetensors"))
        slots = max(shape["topk"] * 2, round(a.share * shape["layers"] * shape["experts"]))
        router = SyntheticRouter(shape["layers"], shape["experts"], shape["topk"], seed=5)
        rng = np.random.default_rng(11)
        res = {"whole": [], "as_ready": [], "floor": [], "ratio": []}
        extra = ["--predict", "off"] if a.no_predict else []
        with harness.Daemon(path, "--slots", slots, *extra) as d, k3client.connect(d.endpoint, name="as_ready") as c:
            for mode in ("whole", "as_ready"):          # warm-up: the cache reaches its steady state
                run_block(c, mode, router, rng, 8, shape["hidden"], check=True)
            for _ in range(a.reps):
                tw, tc = run_block(c, "whole", router, rng, a.tokens, shape["hidden"], a.check, not a.no_predict)
                tr, _ = run_block(c, "as_ready", router, rng, a.tokens, shape["hidden"], a.check, not a.no_predict)
                w, r, f = harness.median(tw), harness.median(tr), harness.median(tc)
                res["whole"].append(w)
                res["as_ready"].append(r)
                res["floor"].append(f)
                res["ratio"].append(r / w)
                if a.verbose:
                    print(f"  rep: floor {f * 1e3:.2f}, whole {w * 1e3:.2f}, as_ready {r * 1e3:.2f} ms/token "
                          f"({r / w:.3f})", flush=True)
            st = c.status()["stats"]
        med = {k: harness.median(v) for k, v in res.items()}
        print(f"slots {slots}; hits {st['hits']}, misses {st['misses']}")
        print(f"floor (compute only)  {med['floor'] * 1e3:8.2f} ms/token  (whole's compute after its fetches)")
        print(f"whole fetch           {med['whole'] * 1e3:8.2f} ms/token  {med['whole'] / med['floor']:5.2f}x floor")
        print(f"fetch_iter (as_ready) {med['as_ready'] * 1e3:8.2f} ms/token  "
              f"{med['as_ready'] / med['floor']:5.2f}x floor")
        print(f"as_ready / whole      {med['ratio']:8.3f}  (median of {a.reps} reps' ratios)")
    finally:
        shutil.rmtree(path, ignore_errors=True)
    return 0


def harness_cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
