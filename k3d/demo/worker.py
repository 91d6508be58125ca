"""One model process of ``k3d demo``: imports only k3client (never daemon code).

Routes tokens through ``layers`` MoE layers with skewed (Zipf-like) routing that
all processes share, predicts the next layer's experts (right most of the
time, as a real router predictor would be), and verifies every fetched expert
against the digest the parent computed from the checkpoint with the
safetensors library.  Prints one JSON line of results.  A process of its own,
one thread (plus the client's lease thread).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import numpy as np
import psutil

import k3client


def popularity(layers: int, experts: int, seed: int) -> np.ndarray:
    """Per-layer expert probabilities: Zipf over a per-layer permutation (shared by all)."""
    rng = np.random.default_rng(seed)
    ranks = 1.0 / np.arange(1, experts + 1) ** 1.1
    probs = np.empty((layers, experts))
    for layer in range(layers):
        probs[layer, rng.permutation(experts)] = ranks / ranks.sum()
    return probs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--digests", required=True)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--experts", type=int, required=True)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--route-seed", type=int, default=0)
    args = ap.parse_args(argv)
    with open(args.digests) as f:
        digests = json.load(f)
    probs = popularity(args.layers, args.experts, args.route_seed)
    rng = np.random.default_rng(args.seed)
    lat, checked, wrong = [], 0, 0
    with k3client.connect(args.endpoint, name=args.name) as c:
        for _ in range(args.tokens):
            c.begin_token()
            route = [rng.choice(args.experts, args.topk, replace=False, p=probs[l]) for l in range(args.layers)]
            for layer in range(args.layers):
                predicted = None
                if layer + 1 < args.layers:
                    guess = [int(e) if rng.random() < 0.75 else int(rng.integers(args.experts))
                             for e in route[layer + 1]]
                    predicted = [(layer + 1, e) for e in dict.fromkeys(guess)]
                t0 = time.perf_counter()
                got = c.fetch(layer, route[layer], predicted=predicted)
                lat.append(time.perf_counter() - t0)
                for ex in got:
                    h = hashlib.blake2b(ex.memory(), digest_size=16).hexdigest()
                    checked += 1
                    wrong += h != digests[f"{ex.layer}/{ex.expert}"]
        mem = psutil.Process().memory_full_info()
        lat_us = np.array(lat) * 1e6
        print(json.dumps({"name": args.name, "fetches": len(lat), "checked": checked, "wrong": wrong,
                          "p50_us": float(np.percentile(lat_us, 50)), "p99_us": float(np.percentile(lat_us, 99)),
                          "rss": mem.rss, "pss": mem.pss}), flush=True)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
