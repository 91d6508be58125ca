"""vLLM's own data parallelism and its Ray executor on vLLM 0.32's CPU build, with and without k3d.

Neither runs a MoE model on this build, and each test shows it with a plain-vLLM run
before it checks what the plugin does with the same engine:

- ``data_parallel_size=2`` (two engine-core processes, one per core, started as vLLM's
  ``data_parallel_offline.py`` example does: one process per rank with ``VLLM_DP_*``):
  plain vLLM dies at its first step, in the MoE layers' data-parallel dispatch
  (``CpuCommunicator`` has no ``all_gatherv``); with the ``k3d`` key each rank refuses in
  one line naming vLLM (``k3client.vllm.guards.parallel_refusal``), before any weight is
  read and before it connects;
- ``distributed_executor_backend="ray"`` with TP=2, on a local Ray cluster the test
  starts on the loopback and stops (its files in a directory of its own, removed after):
  vLLM's CPU platform has no Ray device key, so plain vLLM stops at executor start with
  ``ValueError: current platform cpu does not support ray.``, and with the ``k3d`` key it
  stops on the same line (before the plugin is asked to load anything).  In a worker of
  that cluster, vLLM's plugin loading (``load_general_plugins``, which vLLM's Ray worker
  wrapper calls first) installs the plugin's experts layer through the
  ``vllm.general_plugins`` entry point.

Cost: ~4 min on 2 loaded cores (two DP runs of two engine processes each, ~1.5 min apiece; one Ray
cluster with two engine starts, ~1 min).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest
from test_hf_load import _drop_cache, _resident_pages
from vllm_common import KV_BYTES, _vllm_ipc_files, checkpoint  # noqa: F401 -- the autouse fixture

from conftest import SCRATCH

pytestmark = pytest.mark.vllm
pytest.importorskip("torch")

# One DP rank: vLLM's engine on this rank's share of the prompts (the example's pattern).
DP_RANK = """
import sys
from vllm import LLM, SamplingParams
path, k3d = sys.argv[1], {k3d!r}
extra = {{"additional_config": {{"k3d": k3d}}}} if k3d is not None else {{}}
llm = LLM(model=path, enforce_eager=True, kv_cache_memory_bytes={kv}, skip_tokenizer_init=True, dtype="float32",
          max_model_len=128, max_num_seqs=2, seed=0, **extra)
prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 40, 90, 3, 17, 60], [100, 5]][int(sys.argv[2])::2]
sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
print([list(o.outputs[0].token_ids) for o in llm.generate([{{"prompt_token_ids": p}} for p in prompts], sp)])
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_dp(path: str, k3d: dict | None, timeout: float = 300) -> tuple[list[int], str]:
    """Both ranks of a ``data_parallel_size=2`` deployment, one core each: their exit codes and output
    (stdout and stderr together: vLLM logs its processes' errors to stdout)."""
    code = DP_RANK.format(k3d=k3d, kv=KV_BYTES)
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, VLLM_DP_RANK=str(rank), VLLM_DP_RANK_LOCAL=str(rank), VLLM_DP_SIZE="2",
                   VLLM_DP_MASTER_IP="127.0.0.1", VLLM_DP_MASTER_PORT=str(port),
                   VLLM_CPU_OMP_THREADS_BIND="0|1")          # indexed by the local DP rank
        procs.append(subprocess.Popen([sys.executable, "-c", code, path, str(rank)], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True))
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:             # a rank's engine core or worker that outlived it
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    return [p.returncode for p in procs], "\n".join(out for out, _ in outs)


def test_data_parallel_is_refused_in_one_line_naming_vllm_where_vllm_cannot_run_it():
    path = checkpoint("qwen3_moe", split=True)
    rcs, err = _run_dp(path, None)
    assert rcs != [0, 0]
    assert "NotImplementedError" in err and "all_gatherv" in err and "cpu_communicator.py" in err, err[-4000:]
    shards = [os.path.join(path, n) for n in ("rest.safetensors", "experts.safetensors")]
    for s in shards:
        _drop_cache(s)
    ep = f"ipc://{SCRATCH}/vllm-dp-none.sock"          # no daemon: the refusal comes before connecting
    rcs, err = _run_dp(path, {"endpoint": ep})
    assert rcs[0] != 0 and rcs[1] != 0
    line = ("ValueError: vLLM's CPU build cannot run a MoE model with data_parallel_size=2: its CPU communicator "
            "has no all_gatherv")
    assert err.count(line) >= 2, err[-4000:]                 # each rank's engine core refused
    assert "DaemonNotRunning" not in err
    for s in shards:
        assert _resident_pages(s, 0)[0] == 0, f"{s} was read before the refusal"


RAY = """
import json, os, sys
import ray
ray.init(address="local", include_dashboard=False, num_cpus=2, _temp_dir=sys.argv[2],
         _node_ip_address="127.0.0.1", log_to_driver=False)
out = {}
try:
    @ray.remote
    def plugin_in_a_ray_worker():
        from vllm.plugins import load_general_plugins
        load_general_plugins()                 # what vLLM's RayWorkerWrapper does first
        from vllm.model_executor.custom_op import op_registry_oot
        cls = op_registry_oot.get("RoutedExperts")
        return os.getpid(), f"{cls.__module__}.{cls.__name__}" if cls else None
    out["worker"] = ray.get(plugin_in_a_ray_worker.remote())
    from vllm import LLM
    for name, extra in (("plain", {}), ("k3d", {"additional_config": {"k3d": {"endpoint": sys.argv[3]}}})):
        try:
            LLM(model=sys.argv[1], enforce_eager=True, kv_cache_memory_bytes=%d, skip_tokenizer_init=True,
                dtype="float32", max_model_len=128, max_num_seqs=1, tensor_parallel_size=2,
                distributed_executor_backend="ray", **extra)
            out[name] = "started"
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"
finally:
    ray.shutdown()
print(json.dumps(out))
""" % KV_BYTES


def test_ray_executor_where_vllm_cpu_cannot_run_it_and_the_plugin_in_a_ray_worker():
    path = checkpoint("qwen3_moe")
    tmp = tempfile.mkdtemp(prefix="ray")     # the cluster's files (a short path: Ray's sockets are below)
    dot_ray = os.path.expanduser("~/.ray")                # Ray's per-user state, made by ray.init
    had_dot_ray = os.path.exists(dot_ray)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="0|1",
               RAY_USAGE_STATS_ENABLED="0")
    try:
        r = subprocess.run([sys.executable, "-c", RAY, path, tmp, f"ipc://{SCRATCH}/vllm-ray-none.sock"], env=env,
                           capture_output=True, text=True, timeout=300, check=False, start_new_session=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if not had_dot_ray:
            shutil.rmtree(dot_ray, ignore_errors=True)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    pid, cls = out["worker"]
    assert pid != os.getpid() and cls == "k3client.vllm.experts.K3dRoutedExperts"
    assert out["plain"] == "ValueError: current platform cpu does not support ray.", out
    assert out["k3d"] == out["plain"]                # vLLM stops first, the daemon is never asked
