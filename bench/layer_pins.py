"""Pinned slots per step with layer releases off and on: two replicas at batch 4, a quarter arena.

    python bench/layer_pins.py [--family qwen3_moe] [--layers 6] [--experts 32] [--hidden 128]
                               [--inter 128] [--batch 4] [--tokens 24] [--reps 2]

One run, both settings: a tiny random MoE model written by ``save_pretrained``; for
each setting and repetition (alternating), a fresh ``k3d start`` whose arena holds a
quarter of the routed experts (``--slots``), and two replica processes
(``k3client.hf.load_model``, greedy decode of ``--tokens`` tokens at batch
``--batch``) run at once.  ``K3D_RELEASE_LAYERS=0`` keeps every layer pinned until the
step ends (before); unset, a layer's pins end with its compute (after).

Reported per setting (medians over repetitions and the two replicas):
- pins per step, from the daemon (status ``clients[].step_pins.recent``: per ended
  epoch, the most slots pinned for the replica at once, its fetches' and its
  predictions'); a step (a forward) that began epochs mid-forward peaks at the most
  of its epochs (each replica counts the epochs each forward began); the prefill
  step, then the decode steps' max and median, and the two replicas' medians summed;
- mid-forward epochs per forward (``Runtime.stats``: epochs begun inside a forward
  because the next group did not fit beside what the step held, or a CacheFull);
- CacheFull retries per forward, the hit rate, and the layers the daemon saw released.
Each replica reads its own ``step_pins`` (``Client.status``) before it leaves.

Random weights route nothing like trained ones: the figures describe this toy's
routing (batch-4 unions of top-2 among 32), not a real model's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402

PROMPT_LEN = 12


def worker(argv) -> int:
    ap = argparse.ArgumentParser(prog="layer_pins.py --worker")
    ap.add_argument("path")
    ap.add_argument("endpoint")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    import torch

    from k3client.hf import load_model

    torch.set_num_threads(1)
    model = load_model(a.path, endpoint=a.endpoint, name=f"replica-{a.seed}", dtype=torch.bfloat16)
    ids = torch.randint(0, 128, (a.batch, PROMPT_LEN), generator=torch.Generator().manual_seed(a.seed))
    rt = model.k3d
    through = []                         # per forward: epochs begun by its end (its own and mid-forward ones)
    model.register_forward_hook(lambda *_: through.append(rt.stats.epochs))
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.tokens,
                       min_new_tokens=a.tokens, do_sample=False, pad_token_id=0)
    status = rt.client.status()          # settles the last forward's begin_token first
    pins = next(c for c in status["clients"] if c["id"] == rt.client.client_id)["step_pins"]
    # the daemon's ended epochs in order: its epoch 0 (before the first begin_token), then one
    # per begin_token, i.e. per epoch the runtime began; a forward's peak is its epochs' most
    peak = dict(enumerate(pins["recent"], pins["steps"] - len(pins["recent"])))
    per_forward, before = [], 0
    for upto in through:
        per_forward.append(max(peak[k] for k in range(before + 1, upto + 1)))
        before = upto
    st = rt.stats
    print(json.dumps({"per_forward": per_forward, "forwards": st.forwards, "epochs": st.epochs,
                      "retries": st.cache_full_retries, "released": st.layers_released,
                      "held_max": st.held_max}), flush=True)
    rt.client.close()
    return 0


def replicas(path: str, slots: int, release: bool, a) -> dict:
    d = harness.Daemon(path, "--slots", slots, "--readers", 2)
    try:
        env = dict(os.environ, K3D_RELEASE_LAYERS="1" if release else "0")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", path, d.endpoint,
               "--batch", str(a.batch), "--tokens", str(a.tokens)]
        procs = [subprocess.Popen([*cmd, "--seed", str(i)], env=env, stdout=subprocess.PIPE, text=True)
                 for i in (1, 2)]
        out = []
        for p in procs:
            text, _ = p.communicate(timeout=600)
            if p.returncode:
                raise RuntimeError(f"replica exited {p.returncode}")
            out.append(json.loads(text.strip().splitlines()[-1]))
        from k3client import connect

        with connect(d.endpoint, name="layer-pins-status") as c:
            st = c.status()["stats"]
    finally:
        d.stop()
    return {"replicas": out, "hit_rate": st["hits"] / max(1, st["hits"] + st["misses"]),
            "layers_done": st["layers_done"], "pins_done": st["pins_done"]}


def summary(runs: list[dict]) -> dict:
    """Medians over the runs' replicas; a step is a forward (the first: the prefill)."""
    reps = [r for run in runs for r in run["replicas"]]
    med = statistics.median
    return {
        "prefill_step_pins": med(r["per_forward"][0] for r in reps),
        "decode_step_pins_max": med(max(r["per_forward"][1:]) for r in reps),
        "decode_step_pins_median": med(med(r["per_forward"][1:]) for r in reps),
        "two_replicas_decode_median": med(sum(med(r["per_forward"][1:]) for r in run["replicas"]) for run in runs),
        "mid_forward_epochs_per_forward": med((r["epochs"] - r["forwards"]) / r["forwards"] for r in reps),
        "cache_full_retries_per_forward": med(r["retries"] / r["forwards"] for r in reps),
        "hit_rate": med(run["hit_rate"] for run in runs),
        "layers_released_by_daemon": med(run["layers_done"] for run in runs),
    }


def main() -> int:
    if sys.argv[1:2] == ["--worker"]:
        return worker(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="qwen3_moe")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--inter", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    from k3d.demo import hf_models

    with tempfile.TemporaryDirectory(prefix="k3d-lp-") as tmp:
        path = hf_models.write(a.family, os.path.join(tmp, a.family), hidden=a.hidden, inter=a.inter,
                               layers=a.layers, experts=a.experts)
        slots = a.layers * a.experts // 4
        runs = {False: [], True: []}
        for _ in range(a.reps):
            for release in (False, True):
                runs[release].append(replicas(path, slots, release, a))
    res = {"slots": slots, "experts": a.layers * a.experts, "batch": a.batch, "tokens": a.tokens,
           "before": summary(runs[False]), "after": summary(runs[True])}
    if a.json:
        print(json.dumps(res))
        return 0
    harness.banner("layer pins", f"{a.family}, {a.layers} MoE layers x {a.experts} experts, arena {slots} slots "
                   f"(a quarter), two replicas at batch {a.batch}, {a.tokens} tokens, {a.reps} reps")
    print(f"{'':34}{'before (K3D_RELEASE_LAYERS=0)':>30}{'after':>10}")
    for k in res["before"]:
        b, f = res["before"][k], res["after"][k]
        print(f"{k:34}{b:>30.3g}{f:>10.3g}")
    b, f = res["before"]["decode_step_pins_median"], res["after"]["decode_step_pins_median"]
    print(f"pins per decode step (median): after / before = {f / b:.2f}" if b else "no pins before")
    return 0


if __name__ == "__main__":
    sys.exit(main())
