"""Multi-process: several real client processes share one real daemon.

Each worker routes random tokens (seeded; the seed is printed so a failure can
be replayed), predicts, and compares every tensor of every fetched expert with
``safetensors.safe_open`` byte for byte.
"""

import json
import os
import random
import subprocess
import sys

import k3client
from helpers import TESTS, poll_for

WORKER = r"""
import json, sys, numpy as np, k3client
endpoint, ckpt, seed, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
sys.path.insert(0, sys.argv[5])
from helpers import reference
ref = reference(ckpt)
rng = np.random.default_rng(seed)
keys = wrong = 0
with k3client.connect(endpoint, name=f"w{seed}") as c:
    for t in range(tokens):
        c.begin_token()
        for layer in range(4):
            experts = rng.choice(16, 3, replace=False, p=np.r_[[0.3, 0.2, 0.1], np.full(13, 0.4 / 13)])
            pred = [(layer + 1, int(e)) for e in rng.choice(16, 2, replace=False)] if layer < 3 else None
            for ex in c.fetch(layer, experts, predicted=pred):
                keys += 1
                for spec in c.layout:
                    if not np.array_equal(ex.array(spec.name), ref.expert(ex.layer, ex.expert, spec.name)):
                        wrong += 1
print(json.dumps({"keys": keys, "wrong": wrong}))
"""


def test_four_processes_share_one_arena_and_read_correct_bytes(checkpoint, start_daemon):
    # 52 slots: room for 4 clients x 12 pins per token, fewer than the 64 experts.
    seed = int(os.environ.get("K3D_TEST_SEED", random.randrange(1 << 30)))
    print(f"seed {seed} (rerun with K3D_TEST_SEED={seed})")
    d = start_daemon(checkpoint, "--slots", "52", "--readers", "3")
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, d.endpoint, checkpoint, str(seed + i), "25", TESTS],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(4)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(r["wrong"] for r in results) == 0
    total = sum(r["keys"] for r in results)
    with k3client.connect(d.endpoint, name="check") as c:
        def only_the_checker():          # the workers' sessions end (bye, or reaped)
            st = c.status()
            return st if [x["name"] for x in st["clients"]] == ["check"] else None

        st = poll_for(only_the_checker, 5, lambda: f"only the checker attached: {c.status()['clients']}",
                      interval=0.05)
    s = st["stats"]
    assert s["hits"] + s["misses"] == total
    assert st["arena"]["pinned"] == 0 and s["errors"] == 0
    assert s["evictions"] > 0 and s["hits"] > 0 and s["prefetched"] > 0
    assert d.stop() == 0
