"""vLLM with tensor parallelism (TP=2, one rank per core) serving experts from k3d.

Per family (Qwen3-MoE, Mixtral, DeepSeek-V3): plain vLLM with ``tensor_parallel_size=2``
on a tiny checkpoint is the reference (float32, greedy; four prompts batched, and one
at a time: an engine with ``max_num_seqs=4`` gives steps of B = 4 and B = 1).  The k3d
engine loads its own copy of the checkpoint (experts in a shard of their own, its page
cache dropped first) against a real ``k3d start`` serving the original, and must

- generate plain TP=2's tokens (each rank computes its shard of each expert from the
  whole-expert arena views; vLLM all-reduces the ranks' partial sums);
- be, while it runs, one daemon client per rank, named ``vllm-<pid>-tp<rank>`` after
  the rank's worker process (a child of the engine core);
- leave every page of its copy's experts shard out of the page cache (mincore): no
  rank process read an expert byte;
- send gate-ahead predictions from rank 0 only.

Expert parallelism: vLLM 0.32's CPU worker crashes with it, so with the k3d key it is
refused in one line naming vLLM, before the daemon is even connected.

Cost: two TP=2 engines per family (plain and k3d, each started once: ~16 s to start on an
idle 2-core AMD EPYC) and one refused engine.  Measured 2026-12-04/05 on that machine under
a load average of 7-11 (other test runs): 75-320 s per family, 50-110 s for the refusal.
gpt-oss (bf16) passes the same test (run once, 213 s under load); it is left out to keep CI short.
"""

import os
import shutil
import subprocess
import sys

import psutil
import pytest
from test_hf_load import _drop_cache, _resident_pages
from vllm_common import KV_BYTES, _vllm_ipc_files, checkpoint, engine, generate, plain_engine  # noqa: F401 -- autouse fixture

import k3client
import k3client.vllm
from conftest import spawn_daemon

pytestmark = pytest.mark.vllm
TP = 2
HEAD = 1 << 20        # a shard's header (and its readahead) is read: its first MiB is not checked


@pytest.fixture(scope="module", autouse=True)
def _one_rank_per_core():
    """vLLM's CPU build binds each rank's OpenMP threads to cores; without a binding it asks for
    NUMA nodes this VM does not have.  Set for this module's engines only."""
    if psutil.cpu_count() < TP:
        pytest.skip(f"tensor parallelism {TP} needs {TP} CPU cores (vLLM's CPU build binds one rank per core)")
    old = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(c) for c in range(TP))
    yield
    if old is None:
        del os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    else:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = old


def _tp_engine(path, k3d=None):
    """k3d's engine, or with ``k3d`` None plain vLLM's, the reference: skipped in one line where plain
    vLLM cannot run the family on this CPU (float32 DeepSeek-V3 on an AMX host: AMX_MLA)."""
    if k3d is None:
        return plain_engine(path, tensor_parallel_size=TP, distributed_executor_backend="mp")
    return engine(path, k3d=k3d, tensor_parallel_size=TP, distributed_executor_backend="mp")


def _rank_pids() -> dict[int, int]:
    """{tp rank: pid} of the engine's worker processes (``VLLM::Worker_TP<r>``, under the engine core)."""
    out = {}
    for p in psutil.Process().children(recursive=True):
        try:
            title = (p.cmdline() or [""])[0]
        except psutil.Error:
            continue
        if title.startswith("VLLM::Worker_TP"):
            out[int(title.removeprefix("VLLM::Worker_TP"))] = p.pid
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_tp2_tokens_equal_plain_tp2_one_client_per_rank_no_expert_bytes(family, tmp_path):
    served = checkpoint(family, split=True, inter=256)      # experts shard of a few MiB
    mine = str(tmp_path / "copy")
    shutil.copytree(served, mine)
    shard = os.path.join(mine, "experts.safetensors")
    assert os.path.getsize(shard) > 2 * HEAD
    with _tp_engine(served) as llm:
        ref, ref1 = generate(llm), generate(llm, one_by_one=True)
    for name in ("experts.safetensors", "rest.safetensors"):
        _drop_cache(os.path.join(mine, name))
    before, total = _resident_pages(shard, HEAD)
    assert before == 0, f"could not drop the page cache ({before}/{total} pages resident)"
    d = spawn_daemon(served, "--arena", "16MiB")
    try:
        with _tp_engine(mine, k3d={"endpoint": d.endpoint}) as llm:
            assert generate(llm) == ref
            assert generate(llm, one_by_one=True) == ref1
            pids = _rank_pids()
            with k3client.connect(d.endpoint, name="tp-test-status") as c:
                clients = sorted(x["name"] for x in c.status()["clients"] if x["name"].startswith("vllm-"))
            per_rank = llm.apply_model(k3client.vllm.stats)
    finally:
        d.stop()
    assert sorted(pids) == list(range(TP))
    assert clients == [f"vllm-{pids[r]}-tp{r}" for r in range(TP)]
    assert len(per_rank) == TP and all(s["experts_fetched"] > 0 for s in per_rank)
    # rank 0 alone sends predictions; both ranks fetch the same experts (the same routed tokens)
    assert per_rank[0]["predicted"] > 0 and all(s["predicted"] == 0 for s in per_rank[1:])
    assert len({s["experts_fetched"] for s in per_rank}) == 1
    after, total = _resident_pages(shard, HEAD)
    assert after == 0, f"the engine's ranks read {after} of {total} pages of the experts shard"
    rest, _ = _resident_pages(os.path.join(mine, "rest.safetensors"), 0)
    assert rest > 0, "mincore sees reads: the non-expert shard was read"


def test_expert_parallelism_refused_in_one_line_naming_vllm():
    """EP on vLLM's CPU build: refused before the daemon is connected (this endpoint has none)."""
    from k3client.vllm.ranks import EP_CPU_REFUSAL

    path = checkpoint("qwen3_moe")
    code = ("from vllm import LLM\n"
            f"LLM(model={path!r}, enforce_eager=True, kv_cache_memory_bytes={KV_BYTES}, skip_tokenizer_init=True,"
            f" dtype='float32', max_model_len=128, max_num_seqs=1, tensor_parallel_size={TP},"
            " distributed_executor_backend='mp', enable_expert_parallel=True,"
            " additional_config={'k3d': {'endpoint': 'ipc:///nonexistent/k3d-tp-test.sock'}})\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    out = r.stdout + r.stderr                    # the workers' log lines go to stdout
    assert r.returncode != 0
    assert f"ValueError: {EP_CPU_REFUSAL}" in out, out[-3000:]
    assert "DaemonNotRunning" not in out and "SIGSEGV" not in out
