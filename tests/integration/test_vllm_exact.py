"""vLLM serving experts from k3d generates plain vLLM's greedy tokens, and holds no expert byte.

Per family: a real ``k3d start`` serves a tiny checkpoint written by
``save_pretrained``; plain vLLM on the same checkpoint is the reference (float32,
greedy, several prompts, batched and one at a time).  Qwen3-MoE also checks
what the vLLM process holds and reads: the engine loads its own copy of the
checkpoint, whose experts shard it must never read (mincore after a dropped page
cache), the daemon restarts in the middle of a generation (same tokens), and it
restarts again with an arena of two slots, smaller than one step's experts
(grouped fetches, mid-step epochs).  One k3d engine serves the Qwen3 tests
(module-scoped fixtures: an engine takes ~30 s to start).  Mixtral, DeepSeek-V3 and gpt-oss
(bf16 checkpoint) each compare against their own plain engine.  In bfloat16 the check is
one step's log-probabilities within a stated tolerance.
"""

import os
import shutil
import threading

import pytest
from test_hf_arena import _slot_arena
from test_hf_load import _drop_cache, _resident_pages
from vllm_common import (  # noqa: F401 -- the autouse fixture
    _vllm_ipc_files,
    checkpoint,
    engine,
    expert_params,
    first_logprobs,
    generate,
    plain_engine,
    plain_limit,
    stats,
)

import k3client
from conftest import spawn_daemon
from helpers import poll_for

pytestmark = pytest.mark.vllm
LONG = 100            # tokens of the generation a daemon restart interrupts
BF16_TOL = 0.02       # nats, on one step's top-5 log-probabilities
# nats, the same in float32: at most 5e-7 measured between plain and k3d in one run, but
# plain vLLM alone moves DeepSeek-V3's between engine starts: 7.3e-4 for one token (three
# times under load), and on 2026-12-04 2.18e-3 between two plain starts on a quiet machine
# (twice; k3d against the first of them: 4.8e-7), which failed this test in CI one run in
# four at 2e-3.  So the bound sits above that variation and still far below what a wrong
# layout or activation moves (tokens change, and the tokens are compared exactly)
F32_TOL = 5e-3
HEAD = 1 << 20        # a shard's header (and its readahead) is read: its first MiB is not checked


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """(served checkpoint, the engine's own copy, plain tokens batched, plain tokens one by one)."""
    served = checkpoint("qwen3_moe", split=True, inter=256)     # a 4.7 MB experts shard
    mine = str(tmp_path_factory.mktemp("qwen3") / "copy")
    shutil.copytree(served, mine)
    with engine(served) as llm:
        ref, ref1 = generate(llm), generate(llm, one_by_one=True)
        long = generate(llm, max_tokens=LONG)
        (plain_params,) = llm.apply_model(expert_params)
    # the plugin is loaded in every vLLM process: without the k3d key the experts are vLLM's own
    assert plain_params, "plain vLLM lost its expert parameters"
    return served, mine, ref, ref1, long


def _restart_mid_generation(llm, box, path, want):
    """SIGTERM and restart ``box["daemon"]`` on its endpoint while ``generate`` runs in another thread."""
    d = box["daemon"]
    got, done = [], threading.Event()

    def run():
        got.append(generate(llm, max_tokens=LONG))
        done.set()

    def served():
        s = c.status()["stats"]
        return s["hits"] + s["misses"]

    with k3client.connect(d.endpoint) as c:
        before = served()
        t = threading.Thread(target=run)
        t.start()
        poll_for(lambda: served() > before + 24, 60, "the generation's fetches")
    assert not done.is_set(), "generation ended before the restart: make LONG longer"
    assert d.stop() == 0
    box["daemon"] = spawn_daemon(path, "--arena", "16MiB", endpoint=d.endpoint)
    t.join(120)
    assert got == [want]


@pytest.fixture(scope="module")
def qwen3_k3d(qwen3):
    """One k3d engine for the Qwen3 tests, on its own copy of the checkpoint, started with that
    copy's page cache dropped; ``box["daemon"]`` is the daemon it is on now (tests restart it)."""
    served, mine, *_ = qwen3
    for name in ("experts.safetensors", "rest.safetensors"):
        _drop_cache(os.path.join(mine, name))
    before, total = _resident_pages(os.path.join(mine, "experts.safetensors"), HEAD)
    assert before == 0, f"could not drop the page cache ({before}/{total} pages resident)"
    box = {"daemon": spawn_daemon(served, "--arena", "16MiB")}
    try:
        with engine(mine, k3d={"endpoint": box["daemon"].endpoint}) as llm:
            yield llm, box
    finally:
        box["daemon"].stop()


def test_qwen3_batch4_tokens_equal_and_no_expert_bytes_in_vllm(qwen3, qwen3_k3d):
    served, mine, ref, ref1, long = qwen3
    llm, box = qwen3_k3d
    shard = os.path.join(mine, "experts.safetensors")
    assert os.path.getsize(shard) > 4 * HEAD
    assert generate(llm) == ref
    assert generate(llm, one_by_one=True) == ref1
    (params,) = llm.apply_model(expert_params)
    st = stats(llm)
    _restart_mid_generation(llm, box, served, long)
    assert stats(llm)["daemon_restarts"] == 1
    after, total = _resident_pages(shard, HEAD)
    assert after == 0, f"the vLLM process read {after} of {total} pages of the experts shard"
    rest, _ = _resident_pages(os.path.join(mine, "rest.safetensors"), 0)
    assert rest > 0, "mincore sees reads: the non-expert shard was read"
    assert params == []
    assert st["experts_fetched"] > 0 and st["predicted"] > 0 and 0 < st["predicted_used"] <= st["predicted"]
    # a step fetches the union of its tokens' experts, at most tokens x top-k
    assert 0 < st["experts_per_layer_step"] < st["routed_per_layer_step"]
    assert st["epochs"] == st["forwards"] and st["cache_full_retries"] == 0
    assert (st["native_experts"] > 0) == st["native_kernel"]
    # decode steps: a layer's experts in one native call (native.layer_experts), not one per expert
    assert (0 < st["native_calls"] < st["native_experts"]) == st["native_kernel"]


def test_qwen3_in_an_arena_smaller_than_a_step(qwen3, qwen3_k3d):
    """The same engine once its daemon restarts with two slots, fewer than one step's experts:
    batched (B = 4) and one prompt at a time (B = 1 steps, what ``max_num_seqs=1`` gives)."""
    served, _, ref, ref1, _ = qwen3
    llm, box = qwen3_k3d
    assert box["daemon"].stop() == 0
    box["daemon"] = spawn_daemon(served, "--arena", str(_slot_arena(served, "qwen3_moe", 2)),
                                 endpoint=box["daemon"].endpoint)
    assert generate(llm) == ref                       # the first fetch finds the new daemon
    s0 = stats(llm)
    assert generate(llm, one_by_one=True) == ref1
    assert generate(llm) == ref
    s1 = stats(llm)
    forwards, epochs = s1["forwards"] - s0["forwards"], s1["epochs"] - s0["epochs"]
    assert epochs > forwards                          # groups of two experts, new epochs inside steps
    assert s1["cache_full_retries"] == s0["cache_full_retries"]   # planned from the slot count: never refused


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3", "gpt_oss"])
def test_family_tokens_equal_plain_vllm(family):
    """Mixtral (w1/w2/w3 experts); DeepSeek-V3 (dense first layer, shared experts, grouped sigmoid routing);
    gpt-oss bf16 (stacked, transposed experts with biases, interleaved clamped SwiGLU, softmax over the
    top-k router logits).  Batched (B = 4) and one prompt at a time (B = 1); one step's top-5
    log-probabilities within ``F32_TOL`` too, so a mistake too small to flip a greedy token still shows."""
    path = checkpoint(family)
    with plain_engine(path) as llm:        # float32 DeepSeek-V3 on an AMX CPU: vLLM's AMX_MLA refuses it
        ref, ref1, want = generate(llm), generate(llm, one_by_one=True), first_logprobs(llm)
        (plain_params,) = llm.apply_model(expert_params)
    d = spawn_daemon(path, "--arena", "16MiB")
    # DeepSeek-V3 with the torch path only: the other gated families run k3client.vllm.native's
    # kernel where it builds (Mixtral: gate and up in two views; Qwen3 above: one)
    native = family != "deepseek_v3"
    try:
        with engine(path, k3d={"endpoint": d.endpoint, "native": native}) as llm:
            assert generate(llm) == ref
            assert generate(llm, one_by_one=True) == ref1
            got = first_logprobs(llm)
            st = stats(llm)
            (params,) = llm.apply_model(expert_params)
        assert params == [] and plain_params and st["experts_fetched"] > 0
        # gpt-oss's experts are not rowmm's (transposed, biased): torch
        assert (st["native_experts"] > 0) == (st["native_kernel"] and family == "mixtral")
        _logprobs_close(want, got, F32_TOL)
        if family == "deepseek_v3":
            assert sorted(st["fetch_calls"]) == [1, 2]   # layer 0 is dense: never fetched
    finally:
        d.stop()


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_bfloat16_logprobs_within_tolerance(family):
    """bf16: k3d sums its experts in another order than vLLM's fused kernel, so greedy paths may part
    after some steps (they do on this random Mixtral); one step's top-5 log-probabilities agree within
    ``BF16_TOL`` nats (measured: Mixtral 0.00003-0.004, gpt-oss 0.002-0.004) and name the same top token."""
    path = checkpoint(family)
    with plain_engine(path, dtype="bfloat16") as llm:
        want = first_logprobs(llm)
    d = spawn_daemon(path, "--arena", "16MiB")
    try:
        with engine(path, k3d={"endpoint": d.endpoint}, dtype="bfloat16") as llm:
            got = first_logprobs(llm)
    finally:
        d.stop()
    _logprobs_close(want, got, BF16_TOL)


def _logprobs_close(want, got, tol):
    """Per prompt: the same top token, at least 4 of the top 5 shared, each within ``tol`` nats."""
    for w, g in zip(want, got, strict=True):
        assert max(w, key=w.get) == max(g, key=g.get)
        common = set(w) & set(g)
        assert len(common) >= 4, (w, g)
        assert max(abs(w[t] - g[t]) for t in common) <= tol, (w, g)


def test_plain_vllm_limits_are_read_from_its_traceback():
    """What the family test skips on: vLLM's AMX_MLA refusing a float32 DeepSeek-V3 (the engine core's
    traceback, as an AMX Xeon prints it), and nothing else."""
    amx = ('  File "/venv/lib/python3.11/site-packages/vllm/v1/attention/backends/mla/amx_mla.py", line 303, in '
           'process_weights_after_loading\n    self._w_uk_packed = torch.ops._C.convert_weight_packed(w_uk_for_bmm)\n'
           "RuntimeError: expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8(mxfp4 or int4).\n")
    assert plain_limit(amx) == "its AMX_MLA attention backend needs bf16/fp16/int8 weights"
    assert plain_limit(amx.replace("amx_mla.py", "cpu_moe.py")) is None        # another kernel's check
    assert plain_limit("RuntimeError: Engine core initialization failed. See root cause above.") is None
