"""Per-output-token cost of vLLM with k3d-served experts, against plain vLLM, in one run.

    python bench/vllm_overhead.py [--family qwen3_moe] [--hidden 512] [--inter 1024] [--layers 4]
                                  [--tokens 32] [--reps 3] [--batch 1 4] [--no-predict]
                                  [--dtype bfloat16|float32] [--tp 2]

Needs the ``vllm`` extra.  A tiny random model written by ``save_pretrained``
(``k3d.demo.vllm_models``); a real ``k3d start`` whose default arena holds every
expert (resident after the first run).  Two engines of vLLM's CPU build live in
this process at once, plain vLLM and vLLM with ``additional_config={"k3d": ...}``,
and the repetitions alternate between them, so both see the same machine load.

Per batch size B (B prompts of 8 tokens at once, greedy): the decode time per
step is ``(t(1 + tokens) - t(1)) / tokens`` (prefill and call overhead cancel);
reported as ms per step and per output token, its median over ``--reps``, the
ratio k3d / plain, the fetch time per MoE layer per forward, and how many experts
a step fetched per layer against B x top-k.  In float32 the tokens must be equal
(exit 1 otherwise); in bfloat16 (the default) the per-expert sums round in
another order than vLLM's fused kernel, so greedy paths may part: the share of
equal tokens is printed.  Random weights route nothing like trained ones; this measures the
machinery's cost per step, not a real model's hit rate.

``--tp N``: both engines run N tensor-parallel ranks (``distributed_executor_backend="mp"``;
``VLLM_CPU_OMP_THREADS_BIND`` defaults to one core per rank, ``0|1|...``): each k3d rank
computes its shard of each expert from the shared views, a daemon client of its own;
the fetch figures are rank 0's.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402

import k3client  # noqa: E402
from k3d.demo import vllm_models  # noqa: E402

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")   # apply_model(k3client.vllm.stats)
SHM = "/dev/shm"


def engine(path: str, max_num_seqs: int, k3d: dict | None, dtype: str, tp: int = 1):
    from vllm import LLM

    extra = {"additional_config": {"k3d": k3d}} if k3d is not None else {}
    if tp > 1:
        extra.update(tensor_parallel_size=tp, distributed_executor_backend="mp")
    return LLM(model=path, enforce_eager=True, kv_cache_memory_bytes=256 << 20, skip_tokenizer_init=True,
               dtype=dtype, max_model_len=256, max_num_seqs=max_num_seqs, seed=0, **extra)


def timed(llm, prompts, tokens: int) -> tuple[float, list]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]


def step_time(llm, prompts, tokens: int) -> tuple[float, list]:
    """Seconds per decode step (prefill cancelled out) and the tokens of the long run."""
    t1, _ = timed(llm, prompts, 1)
    tn, toks = timed(llm, prompts, 1 + tokens)
    return max(tn - t1, 0.0) / tokens, toks


def stats(llm) -> dict:
    from k3client.vllm import stats as model_stats

    return llm.apply_model(model_stats)[0]


def cpu_seconds(daemon_pid: int, client_pids: list[int]) -> tuple[float, float, float]:
    """CPU seconds so far of the daemon (every thread), of the k3d engine's rank processes'
    main threads (their model compute) and of their other threads (ZeroMQ I/O, the lease
    thread, torch's and vLLM's helpers): what competes with the ranks for their cores."""
    import psutil

    d = psutil.Process(daemon_pid).cpu_times()
    main = side = 0.0
    for pid in client_pids:
        with contextlib.suppress(psutil.Error):
            for t in psutil.Process(pid).threads():
                if t.id == pid:
                    main += t.user_time + t.system_time
                else:
                    side += t.user_time + t.system_time
    return d.user + d.system, main, side


def _remove_tp_buffers(before: set) -> None:
    """vLLM's CPU build leaves each TP engine's all-reduce buffers (``/dev/shm/vllm_dist_*``, 4 MiB
    per rank) behind at shutdown: the new ones no process maps any more are removed."""
    new = {n for n in set(os.listdir(SHM)) - before if n.startswith("vllm_dist_")}
    for maps in glob.glob("/proc/[0-9]*/maps"):
        if not new:
            break
        with contextlib.suppress(OSError), open(maps) as f:
            text = f.read()
            new = {n for n in new if f"{SHM}/{n}" not in text}
    for n in new:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(SHM, n))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="qwen3_moe", choices=["qwen3_moe", "mixtral"])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--inter", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--no-predict", action="store_true")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="the engines' dtype; the checkpoint is bf16, so float32 casts each fetched expert")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of both engines (one core each)")
    a = ap.parse_args()
    if a.tp > 1:
        # vLLM's CPU build binds each rank's threads; without a binding it asks for NUMA nodes
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(c) for c in range(a.tp)))
    tmp = tempfile.mkdtemp(prefix="k3d-vb-")
    # vLLM's engines make their ZMQ ipc sockets there, removed with it (else they stay in /tmp)
    os.environ.setdefault("VLLM_RPC_BASE_PATH", tmp)
    ok, rows, agree = True, [], []
    shm_before = set(os.listdir(SHM))
    try:
        path = vllm_models.write(a.family, os.path.join(tmp, a.family), hidden=a.hidden, inter=a.inter,
                                 layers=a.layers)
        from k3d.demo.hf_models import expert_bytes

        ebytes = expert_bytes(path)
        with harness.Daemon(path) as d:
            for b in a.batch:
                prompts = [[(7 * i + j) % 120 + 1 for j in range(8)] for i in range(b)]
                plain = engine(path, b, None, a.dtype, a.tp)
                k3d = engine(path, b, {"endpoint": d.endpoint, "predict": not a.no_predict}, a.dtype, a.tp)
                step_time(k3d, prompts, a.tokens)            # cold: every expert a miss
                step_time(plain, prompts, a.tokens)
                s0 = stats(k3d)
                with k3client.connect(d.endpoint, name="bench-status", hit_path="daemon") as c:
                    pids = sorted({cl["pid"] for cl in c.status()["clients"] if cl["name"].startswith("vllm-")})
                tp, tk, cpu = [], [], [0.0, 0.0, 0.0]
                for _ in range(a.reps):
                    t, want = step_time(plain, prompts, a.tokens)
                    tp.append(t)
                    c0 = cpu_seconds(d.pid, pids)
                    t, got = step_time(k3d, prompts, a.tokens)
                    cpu = [x + y1 - y0 for x, y0, y1 in zip(cpu, c0, cpu_seconds(d.pid, pids))]
                    tk.append(t)
                    ok &= got == want
                    agree += [x == y for g, w in zip(got, want) for x, y in zip(g, w)]
                s1 = stats(k3d)
                for llm in (plain, k3d):
                    llm.llm_engine.engine_core.shutdown()
                del plain, k3d
                # step_time runs 1 + (1 + tokens) steps per rep
                per_step = [1e3 * x / (a.reps * (a.tokens + 2)) for x in cpu]
                rows.append((b, statistics.median(tp), statistics.median(tk), s0, s1, per_step, len(pids)))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_tp_buffers(shm_before)
    harness.banner("vllm_overhead", f"{a.family} hidden {a.hidden} inter {a.inter}, {a.layers} layers, routed "
                   f"experts {ebytes / 2**20:.1f} MiB; {a.tokens} decode steps x {a.reps} reps, {a.dtype}, TP {a.tp}, "
                   f"predictions {'off' if a.no_predict else 'on'}")
    import torch

    from k3client import cpu
    from k3client.runtime import dispatch
    from k3client.vllm import native

    facts = cpu.facts()
    kern = dispatch.kernels(facts, "cpu", getattr(torch, a.dtype), native.load() is not None, True)
    print(f"  CPU: {cpu.model_name()}, {facts.describe()}, {os.cpu_count()} cores; "
          f"plugin experts: {kern.describe()}")
    for b, mp, mk, s0, s1, per_step, ranks in rows:
        steps = s1["forwards"] - s0["forwards"]
        fs0 = s0["fetch_seconds"]
        per_layer = {k: 1e3 * (v - fs0.get(k, 0.0)) / steps for k, v in sorted(s1["fetch_seconds"].items())}
        union = (s1["union"] - s0["union"]) / max(1, s1["layer_steps"] - s0["layer_steps"])
        routed = (s1["routed"] - s0["routed"]) / max(1, s1["layer_steps"] - s0["layer_steps"])
        print(f"  batch {b}: plain {1e3 * mp:7.2f} ms/step ({1e3 * mp / b:6.2f} ms/token)   "
              f"k3d {1e3 * mk:7.2f} ms/step   ratio {mk / mp:.2f}x")
        print("           fetch per layer per forward " + "  ".join(f"L{k} {v:.3f} ms" for k, v in per_layer.items())
              + f"; experts fetched per layer-step {union:.1f} of {routed:.1f} routed (tokens x top-k)")
        print(f"           CPU per k3d step (ms, all {ranks} ranks): daemon {per_step[0]:.3f}, ranks' main threads "
              f"{per_step[1]:.3f}, ranks' other threads {per_step[2]:.3f}")
    print(f"  same tokens: {ok} ({sum(agree)}/{len(agree)} equal, position by position)")
    return 0 if ok or a.dtype != "float32" else 1


if __name__ == "__main__":
    sys.exit(main())
