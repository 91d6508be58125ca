"""A real MoE FFN layer on CPU from experts served by k3d, against the checkpoint read directly.

    python bench/forward.py [--tokens 32] [--layers 4] [--experts 32] [--hidden 1024] [--inter 512] [--threads 1]

For each format (safetensors with OCP MXFP4 tensors; GGUF with GGML MXFP4 blocks;
the GGUF packed by ``k3d pack`` and served with ``--read-mode direct``): a real
``k3d start`` serves the checkpoint; for every layer, top-4 routing over the
router weights, then SwiGLU (w2 @ (silu(w1 x) * w3 x)) per selected expert,
with weights decoded by ``k3client.mxfp4`` from zero-copy arena views.  The
reference computes the same layer from the tensors read by the ``safetensors``
/ ``gguf`` libraries (GGUF decoded by ``gguf.quants``).  Outputs must be equal
(``torch.equal``); the script exits 1 otherwise.

Reported per format: ms per layer for the reference (library read + decode +
compute), k3d cold (misses), k3d warm (hits), and the weight bytes fetched.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import k3client  # noqa: E402
from k3client.mxfp4 import dequantize  # noqa: E402

TOP_K = 4
PATTERN = "model.layers.{layer}.mlp.experts.{expert}.{name}"


def moe_ffn(x, router_w, weights):
    """Top-k routed SwiGLU FFN; ``weights(experts)`` -> {e: (w1, w3, w2)}."""
    top, idx = torch.topk(x @ router_w.T, TOP_K, dim=-1)
    gates = torch.softmax(top, dim=-1)
    used = sorted(set(idx.flatten().tolist()))
    ws = weights(used)
    out = torch.zeros_like(x)
    for e in used:
        tok, k = (idx == e).nonzero(as_tuple=True)
        w1, w3, w2 = ws[e]
        h = F.silu(x[tok] @ w1.T) * (x[tok] @ w3.T)
        out.index_add_(0, tok, (h @ w2.T) * gates[tok, k, None])
    return out


class Safetensors:
    name = "safetensors (OCP MXFP4)"

    def __init__(self, path):
        from safetensors import safe_open

        self.path, self.safe_open = path, safe_open
        self.file = os.path.join(path, "model.safetensors")

    def router(self, layer):
        with self.safe_open(self.file, "pt") as f:
            return f.get_tensor(f"model.layers.{layer}.mlp.router.weight").float()

    def reference(self, layer):
        def weights(used):
            out = {}
            with self.safe_open(self.file, "pt") as f:
                for e in used:
                    def t(n, e=e):
                        return f.get_tensor(PATTERN.format(layer=layer, expert=e, name=n))
                    out[e] = tuple(dequantize(t(f"{m}.weight_packed"), t(f"{m}.weight_scale"))
                                   for m in ("w1", "w3", "w2"))
            return out
        return weights

    @staticmethod
    def decode(ex):
        return tuple(dequantize(ex.tensor(f"{m}.weight_packed"), ex.tensor(f"{m}.weight_scale"))
                     for m in ("w1", "w3", "w2"))


class Gguf:
    name = "gguf (GGML MXFP4)"

    def __init__(self, path):
        from gguf import GGUFReader
        from gguf.quants import dequantize as gq

        self.path, self.gq = path, gq
        self.by = {t.name: t for t in GGUFReader(path).tensors}

    def router(self, layer):
        return torch.from_numpy(np.array(self.by[f"blk.{layer}.ffn_gate_inp.weight"].data, np.float32))

    def reference(self, layer):
        def weights(used):
            out = {}
            for e in used:
                out[e] = tuple(torch.from_numpy(np.array(self.gq(t.data[e], t.tensor_type), np.float32))
                               for t in (self.by[f"blk.{layer}.ffn_{p}_exps.weight"] for p in ("gate", "up", "down")))
            return out
        return weights

    @staticmethod
    def decode(ex):
        return tuple(dequantize(ex.tensor(f"ffn_{p}_exps.weight"), layout="ggml") for p in ("gate", "up", "down"))


def run_format(fmt, source, extra, layers, tokens, hidden, seed) -> dict:
    rng = np.random.default_rng(seed)
    xs = [torch.from_numpy(rng.standard_normal((tokens, hidden)).astype(np.float32) * 0.05) for _ in range(layers)]
    routers = [fmt.router(layer) for layer in range(layers)]
    t0 = time.perf_counter()
    refs = [moe_ffn(xs[layer], routers[layer], fmt.reference(layer)) for layer in range(layers)]
    t_ref = (time.perf_counter() - t0) / layers
    with harness.Daemon(source, "--arena", "512MiB", *extra) as d, k3client.connect(d.endpoint, name="forward") as c:
        times = []
        for _ in range(2):   # cold pass (misses), then warm (hits)
            t0 = time.perf_counter()
            for layer in range(layers):
                c.begin_token()

                def served(used, layer=layer):
                    return {ex.expert: fmt.decode(ex) for ex in c.fetch(layer, used)}
                out = moe_ffn(xs[layer], routers[layer], served)
                if not torch.equal(out, refs[layer]):
                    raise SystemExit(f"{fmt.name}: layer {layer} output differs from the reference "
                                     f"(max abs diff {(out - refs[layer]).abs().max().item():g})")
            times.append((time.perf_counter() - t0) / layers)
        st = c.status()
    return {"ref_ms": t_ref * 1e3, "cold_ms": times[0] * 1e3, "warm_ms": times[1] * 1e3,
            "bytes_read": st["stats"]["bytes_read"], "misses": st["stats"]["misses"], "hits": st["stats"]["hits"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: OpenMP spinning on a shared VM hurts)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from k3d.demo.synthetic import write_checkpoint, write_synthetic_gguf
    from k3d.sources import open_source
    from k3d.sources.packwrite import write_pack

    tmp = tempfile.mkdtemp(prefix="k3d-bench-fwd-", dir="/tmp")
    try:
        st = write_checkpoint(os.path.join(tmp, "st"), layers=args.layers, experts=args.experts,
                              hidden=args.hidden, inter=args.inter, seed=args.seed)
        gg = write_synthetic_gguf(os.path.join(tmp, "m.gguf"), layers=args.layers, experts=args.experts,
                                  hidden=args.hidden, inter=args.inter, seed=args.seed)
        src = open_source(gg, PATTERN)
        pk = write_pack(src, os.path.join(tmp, "m.k3pack"), progress=False)["path"]
        src.close()
        harness.banner("forward", f"{args.layers} layers x {args.experts} experts, hidden {args.hidden}, "
                                  f"inter {args.inter}, {args.tokens} tokens, top-{TOP_K}")
        print(f"{'format':<34}{'equal':>6}{'ref ms':>9}{'cold ms':>9}{'warm ms':>9}{'MB read':>9}")
        for fmt, source, extra in ((Safetensors(st), st, []), (Gguf(gg), gg, []),
                                   (Gguf(gg), pk, ["--read-mode", "direct"])):
            label = fmt.name + (" packed, direct" if source == pk else "")
            r = run_format(fmt, source, extra, args.layers, args.tokens, args.hidden, args.seed)
            print(f"{label:<34}{'yes':>6}{r['ref_ms']:>9.1f}{r['cold_ms']:>9.1f}{r['warm_ms']:>9.1f}"
                  f"{r['bytes_read'] / 1e6:>9.1f}", flush=True)
        print(json.dumps({"all_equal": True}))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
