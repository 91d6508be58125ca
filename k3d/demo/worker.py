"""One model process of ``k3d demo``: imports k3client and the demo's router, never daemon code.

Routes tokens through ``layers`` MoE layers with ``k3d.demo.routing.SyntheticRouter``
(one model shared by all processes, each its own text): routing with the shared
Mixtral trace's statistics (reuse ~1.4x chance, nearly flat popularity), and
gate-ahead predictions of the next layer's experts from the current hidden state,
right only as often as a real gate-ahead predictor is.  Verifies every fetched
expert against the digest the parent computed from the checkpoint with the
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
from k3d.demo.routing import DEMO, SyntheticRouter


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
    router = SyntheticRouter(args.layers, args.experts, args.topk, seed=args.route_seed, stream=args.seed, **DEMO)
    lat, checked, wrong = [], 0, 0
    with k3client.connect(args.endpoint, name=args.name) as c:
        for _ in range(args.tokens):
            c.begin_token()
            route, ahead = router.token()
            for layer in range(args.layers):
                predicted = [(layer + 1, e) for e in ahead[layer]] or None
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
