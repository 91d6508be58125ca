"""Per-token cost of k3d-served experts in a transformers model, against in-process experts.

    python bench/hf_overhead.py [--family qwen3_moe] [--hidden 512] [--inter 1024] [--layers 4]
                                [--tokens 16] [--reps 5] [--threads 1] [--no-predict]

One process, one run: a tiny random model written by ``save_pretrained``; a real
``k3d start`` with its default arena serves its routed experts.  The same
checkpoint is loaded twice: plain transformers with ``experts_implementation=
"eager"`` (the floor: experts in this process's memory) and ``k3client.hf.
load_model`` (experts from the daemon, the family's eager math on arena views).
Greedy decode of ``--tokens`` tokens, alternating the two models for ``--reps``
repetitions; reported: median ms per token of each, the ratio k3d / eager, the
first (cold: every expert a miss) k3d run, and the fetch time per layer (the
round trip, wait and view building of ``Client.fetch``) per token.  The token
sequences must be equal (exit 1 otherwise).

Random weights route nothing like trained ones; what this measures is the
per-fetch cost, which does not depend on the routing once the experts are warm.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from k3client.hf import load_model  # noqa: E402
from k3d.demo import hf_models  # noqa: E402


def decode(model, ids, tokens: int) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
    return (time.perf_counter() - t0) / tokens, out[0, ids.shape[1]:].tolist()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="qwen3_moe", choices=sorted(hf_models.FAMILIES))
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--inter", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-predict", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tmp = tempfile.mkdtemp(prefix="k3d-hfb-")
    try:
        path = hf_models.write(a.family, os.path.join(tmp, a.family), hidden=a.hidden, inter=a.inter, layers=a.layers)
        ebytes = hf_models.expert_bytes(path)
        with harness.Daemon(path) as d:        # the family is recognised from config.json: no --pattern
            eager = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, experts_implementation="eager")
            k3d = load_model(path, endpoint=d.endpoint, predict=not a.no_predict, dtype=torch.bfloat16)
            ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
            cold, want = decode(k3d, ids, a.tokens)
            decode(eager, ids, a.tokens)
            t_eager, t_k3d, same = [], [], True
            st = k3d.k3d.stats
            st.fetch_seconds.clear()
            st.fetch_calls.clear()
            for _ in range(a.reps):
                te, got_e = decode(eager, ids, a.tokens)
                tk, got_k = decode(k3d, ids, a.tokens)
                t_eager.append(te)
                t_k3d.append(tk)
                same &= got_e == want == got_k
            status = k3d.k3d.client.status()
            k3d.k3d.client.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    me, mk = statistics.median(t_eager), statistics.median(t_k3d)
    forwards = a.reps * a.tokens        # generate runs one forward per new token
    harness.banner("hf_overhead", f"{a.family} hidden {a.hidden} inter {a.inter}, {a.layers} layers, routed experts "
                   f"{ebytes / 2**20:.1f} MiB; {a.tokens} tokens x {a.reps} reps, {a.threads} torch thread(s), "
                   f"predictions {'off' if a.no_predict else 'on'}")
    print(f"  eager (in-process experts)  {1e3 * me:8.2f} ms/token   (floor)")
    print(f"  k3d (daemon-served)         {1e3 * mk:8.2f} ms/token   ratio {mk / me:.2f}x")
    print(f"  k3d first run (cold)        {1e3 * cold:8.2f} ms/token   ratio {cold / me:.2f}x")
    per_layer = {layer: 1e3 * s / forwards for layer, s in sorted(st.fetch_seconds.items())}
    print("  fetch per layer per token   " + "  ".join(f"L{k} {v:.3f} ms" for k, v in per_layer.items()))
    print(f"  fetch share of the k3d token: {sum(per_layer.values()) / (1e3 * mk):.0%}; "
          f"daemon hits {status['stats']['hits']} misses {status['stats']['misses']}")
    print(f"  same tokens: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
