"""``k3d demo --hf`` / ``examples/hf_generate.py``: N transformers processes share one k3d.

1. Writes a tiny random MoE model with transformers' ``save_pretrained``
   (``hf_models``; Qwen3-MoE by default, ~96 MB of routed experts).
2. Starts a real daemon (``k3d start``) whose arena holds half of the experts.
3. Runs ``clients`` processes that each ``load_model`` it (routed experts served
   by the daemon, never loaded) and greedily generate; then the same number of
   plain transformers processes (experts in their own memory: the no-k3d
   baseline), in the same run.
4. While all processes of a kind are alive, reads each one's PSS/RSS from the
   outside (psutil), then lets them exit.  Prints tokens/s, hit rate, prediction
   precision, per-process memory, and checks that the k3d processes' PSS sum is
   below the baseline's by at least (N - 1) x expert bytes.

The daemon and the workers are ``k3d.demo.children``: a Ctrl-C stops them and
removes the model; the caller prints one line and exits 130.

A worker is ``python -m k3d.demo.hf worker PATH [--endpoint EP] ...``: it prints
one JSON line per generated token, then a result line, then waits for stdin to
close (so its memory can be read while its siblings are alive).

Random weights route nothing like trained ones: the hit rate and the precision
printed here describe this toy, not a real model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import psutil

from . import hf_models
from .children import PYTHON, Children, interrupted

PROMPT_LEN = 12


def prompt(seed: int, vocab: int = 128):
    import torch  # optional extra (hf)

    return torch.randint(0, vocab, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(seed))


def worker(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="k3d.demo.hf worker")
    ap.add_argument("path")
    ap.add_argument("--endpoint")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eager", action="store_true", help="plain transformers, experts in this process")
    ap.add_argument("--no-predict", action="store_true")
    ap.add_argument("--hold", action="store_true", help="wait for stdin to close before exiting")
    a = ap.parse_args(argv)
    import torch  # optional extra (hf)
    from transformers import AutoModelForCausalLM, TextStreamer

    torch.set_num_threads(1)
    if a.eager:
        model = AutoModelForCausalLM.from_pretrained(a.path, dtype=torch.bfloat16, experts_implementation="eager")
    else:
        from k3client.hf import load_model
        model = load_model(a.path, endpoint=a.endpoint, name=f"hf-demo-{os.getpid()}",
                           predict=not a.no_predict, dtype=torch.bfloat16)

    class Tokens(TextStreamer):
        def __init__(self):
            self.n = 0

        def put(self, value):
            self.n += 1
            print(json.dumps({"step": self.n}), flush=True)

        def end(self):
            pass

    ids = prompt(a.seed)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=a.tokens, min_new_tokens=a.tokens, do_sample=False,
                             streamer=Tokens(), pad_token_id=0)
    dt = time.perf_counter() - t0
    res = {"pid": os.getpid(), "tokens": out[0, ids.shape[1]:].tolist(), "seconds": dt,
           "tok_s": a.tokens / dt, "eager": a.eager}
    if not a.eager:
        rt = model.k3d
        res["stats"] = {k: v for k, v in rt.stats.as_dict().items() if not isinstance(v, dict)}
        res["fetch_ms_per_layer"] = {str(k): 1e3 * v / rt.stats.fetch_calls[k]
                                     for k, v in rt.stats.fetch_seconds.items()}
        res["fetch_seconds"] = sum(rt.stats.fetch_seconds.values())     # of "seconds": round trips
    print(json.dumps({"result": res}), flush=True)
    if a.hold:
        sys.stdin.read()
    return 0


def _spawn(children, path, endpoint, tokens, seed, eager, predict=True):
    cmd = [*PYTHON, "-m", "k3d.demo.hf", "worker", path, "--tokens", str(tokens), "--seed", str(seed), "--hold"]
    cmd += ["--eager"] if eager else ["--endpoint", endpoint] + ([] if predict else ["--no-predict"])
    return children.start(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def _collect(procs, timeout: float = 300) -> list[dict]:
    """Each worker's result line; memory read while all are alive; then they exit."""
    results = []
    for p in procs:
        for line in p.stdout:
            msg = json.loads(line)
            if "result" in msg:
                results.append(msg["result"])
                break
        else:
            raise RuntimeError(f"worker {p.pid} exited {p.wait()} without a result")
    for p, r in zip(procs, results):
        mem = psutil.Process(p.pid).memory_full_info()
        r["pss"], r["rss"] = mem.pss, mem.rss
    for p in procs:
        p.stdin.close()
        p.wait(timeout)
    return results


def run_hf_demo(clients: int = 3, tokens: int = 16, family: str = "qwen3_moe", hidden: int = 512,
                inter: int = 1024, layers: int = 4, arena_fraction: float = 0.5, as_json: bool = False) -> int:
    from k3client import connect

    try:
        import k3client.hf  # noqa: F401  (transformers >= 5 and torch: the hf extra)
    except ImportError as e:
        print(f"k3d demo --hf: {e}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="k3d-hf-demo-") as tmp:
        path = hf_models.write(family, os.path.join(tmp, family), hidden=hidden, inter=inter, layers=layers)
        ebytes = hf_models.expert_bytes(path)
        endpoint = f"ipc://{tmp}/k3d.sock"
        arena = max(1 << 20, int(ebytes * arena_fraction))
        cmd = [*PYTHON, "-m", "k3d", "start", "--source", path, "--endpoint", endpoint,
               "--arena", str(arena), "--state-dir", "none"]     # a throw-away daemon: nothing to keep
        with open(os.path.join(tmp, "daemon.log"), "w+") as log, Children() as children:
            daemon = children.start(cmd, stdout=log, stderr=subprocess.STDOUT)
            _wait_ready(log, daemon)
            t0 = time.perf_counter()
            k3d_res = _collect([_spawn(children, path, endpoint, tokens, i, eager=False) for i in range(clients)])
            k3d_wall = time.perf_counter() - t0
            with connect(endpoint, name="hf-demo-status") as c:
                status = c.status()
            dmem = psutil.Process(daemon.pid).memory_full_info()
            t0 = time.perf_counter()
            eager_res = _collect([_spawn(children, path, endpoint, tokens, i, eager=True) for i in range(clients)])
            eager_wall = time.perf_counter() - t0
            daemon.terminate()
            daemon.wait(30)
    report = _report(clients, tokens, ebytes, arena, k3d_res, eager_res, status, dmem, k3d_wall, eager_wall)
    if as_json:
        print(json.dumps(report))
    else:
        _print(report)
    return 0 if report["ok"] else 1


def _wait_ready(log, daemon, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log.seek(0)
        text = log.read()
        if "k3d: ready" in text:
            return
        if daemon.poll() is not None:
            raise RuntimeError(f"k3d exited {daemon.returncode}:\n{text}")
        time.sleep(0.05)
    raise RuntimeError("k3d did not become ready")


def _report(n, tokens, ebytes, arena, k3d_res, eager_res, status, dmem, k3d_wall, eager_wall) -> dict:
    st = status["stats"]
    fetched = st["hits"] + st["misses"]
    predicted = sum(r["stats"]["predicted"] for r in k3d_res)
    used = sum(r["stats"]["predicted_used"] for r in k3d_res)
    pss_k3d, pss_eager = sum(r["pss"] for r in k3d_res), sum(r["pss"] for r in eager_res)
    same = all(a["tokens"] == b["tokens"] for a, b in zip(k3d_res, eager_res))
    return {
        "clients": n, "tokens": tokens, "expert_bytes": ebytes, "arena_bytes": arena,
        "k3d": k3d_res, "eager": eager_res, "same_tokens": same,
        "hit_rate": st["hits"] / fetched if fetched else None,
        "prediction_precision": used / predicted if predicted else None,
        "daemon_prefetched": st.get("prefetched"), "daemon_prefetch_unused": st.get("prefetch_unused"),
        "daemon_pss": dmem.pss, "daemon_rss": dmem.rss,
        "pss_sum_k3d": pss_k3d, "pss_sum_eager": pss_eager, "pss_saved": pss_eager - pss_k3d,
        "pss_needed": (n - 1) * ebytes, "ok": same and pss_eager - pss_k3d >= (n - 1) * ebytes,
        "tok_s_k3d": n * tokens / k3d_wall, "tok_s_eager": n * tokens / eager_wall,
        "slot_bytes": status["arena"]["expert_bytes"],
    }


def _print(r: dict) -> None:
    mb = 1 / 2**20
    print(f"k3d demo --hf: {r['clients']} processes x {r['tokens']} tokens, "
          f"routed experts {r['expert_bytes'] * mb:.1f} MiB, "
          f"arena {r['arena_bytes'] * mb:.1f} MiB (random weights: routing unlike a trained model)")
    for kind in ("k3d", "eager"):
        for w in r[kind]:
            extra = ""
            # tok/s says what it includes: a k3d process waits on a round trip to the daemon per
            # fetch, which weighs heavily beside this toy model's tiny experts
            why = "(experts in its own memory: no round trips)"
            if kind == "k3d":
                s = w["stats"]
                extra = f"  epochs {s['epochs']}  predicted {s['predicted']} (used {s['predicted_used']})"
                why = (f"({w['fetch_seconds'] / w['seconds']:.0%} of its time in {s['fetches']} round trips to "
                       f"the daemon, {1e3 * w['fetch_seconds'] / max(s['fetches'], 1):.1f} ms each, in a toy model of "
                       f"{r['slot_bytes'] * mb:.1f} MiB experts)")
            print(f"  {kind:5} pid {w['pid']}: {w['tok_s']:6.1f} tok/s {why}  PSS {w['pss'] * mb:7.1f} MiB  "
                  f"RSS {w['rss'] * mb:7.1f} MiB{extra}")
    hr = r["hit_rate"]
    pp = r["prediction_precision"]
    print(f"  hit rate {hr:.1%}" if hr is not None else "  hit rate n/a", end="")
    print(f"   prediction precision {pp:.1%}" if pp is not None else "   no predictions", end="")
    print(f"   daemon prefetched {r['daemon_prefetched']} (unused {r['daemon_prefetch_unused']})")
    print(f"  same tokens with and without k3d: {r['same_tokens']}")
    print(f"  PSS sum: k3d {r['pss_sum_k3d'] * mb:.1f} MiB vs plain {r['pss_sum_eager'] * mb:.1f} MiB: saved "
          f"{r['pss_saved'] * mb:.1f} MiB, (N-1) x expert bytes = {r['pss_needed'] * mb:.1f} MiB "
          f"-> {'OK' if r['ok'] else 'NOT MET'}  (daemon PSS {r['daemon_pss'] * mb:.1f} MiB, not in either sum)")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        return worker(argv[1:])
    ap = argparse.ArgumentParser(prog="hf_generate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=3,
                    help="model processes of each kind: with k3d, then plain transformers (default 3)")
    ap.add_argument("--tokens", type=int, default=16, help="tokens each process generates (default 16)")
    ap.add_argument("--family", default="qwen3_moe", choices=sorted(hf_models.FAMILIES),
                    help="the tiny random model's family (default qwen3_moe)")
    ap.add_argument("--hidden", type=int, default=512, help="its hidden size (default 512)")
    ap.add_argument("--inter", type=int, default=1024, help="its experts' intermediate size (default 1024)")
    ap.add_argument("--json", action="store_true", help="print the report as one JSON line")
    a = ap.parse_args(argv)
    try:
        return run_hf_demo(clients=a.clients, tokens=a.tokens, family=a.family, hidden=a.hidden, inter=a.inter,
                           as_json=a.json)
    except KeyboardInterrupt as e:       # Ctrl-C: the children are stopped by now
        return interrupted("hf_generate", e)


if __name__ == "__main__":
    sys.exit(main())
