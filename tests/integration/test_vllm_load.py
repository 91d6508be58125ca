"""The vLLM plugin refuses in one line: daemon down (before any weight is read), another
checkpoint, a fine-tune of the served one, experts it cannot compute (gpt-oss's MXFP4 without AMX).

Each case builds an in-process engine in a fresh Python (``run_engine_script``) and
reads the last line of its stderr, what a person running ``vllm serve`` sees last.
"""

import os

import pytest
from test_hf_load import _drop_cache, _resident_pages
from vllm_common import _vllm_ipc_files, checkpoint, run_engine_script  # noqa: F401 -- the autouse fixture

from conftest import SCRATCH, spawn_daemon
from k3client import cpu

pytestmark = pytest.mark.vllm
torch = pytest.importorskip("torch")


def test_daemon_down_is_one_line_before_any_weight_is_read():
    path = checkpoint("qwen3_moe", split=True)
    shards = [os.path.join(path, n) for n in ("rest.safetensors", "experts.safetensors")]
    for s in shards:
        _drop_cache(s)
    ep = f"ipc://{SCRATCH}/vllm-none.sock"
    rc, last, err = run_engine_script(path, {"endpoint": ep})
    assert rc != 0
    assert "DaemonNotRunning" in last and ep in last, err[-3000:]
    for s in shards:
        assert _resident_pages(s, 0)[0] == 0, f"{s} was read before the daemon was asked"


def test_other_checkpoint_is_one_line_mismatch():
    served, other = checkpoint("qwen3_moe"), checkpoint("mixtral")
    d = spawn_daemon(served, "--arena", "8MiB")
    try:
        rc, last, err = run_engine_script(other, {"endpoint": d.endpoint})
    finally:
        d.stop()
    assert rc != 0
    assert "Mismatch" in last and served in last and other in last and "k3d start --source" in last, err[-3000:]


def test_fine_tune_is_one_line_mismatch():
    """Issue 32: another tiny Qwen3-MoE of the served one's shapes (seed 1 against the served seed 0),
    which plain vLLM would run with the served experts, is refused in one line naming both
    (``Client.verify``: sampled bytes, before vLLM builds the model)."""
    served, other = checkpoint("qwen3_moe"), checkpoint("qwen3_moe", seed=1)
    d = spawn_daemon(served, "--arena", "8MiB")
    try:
        rc, last, err = run_engine_script(other, {"endpoint": d.endpoint})
    finally:
        d.stop()
    assert rc != 0
    assert "Mismatch" in last and "holds other bytes" in last and served in last and other in last, err[-3000:]


@pytest.mark.skipif(cpu.facts().amx, reason="this CPU has AMX: plain vLLM and the plugin compute gpt-oss's MXFP4 "
                    "here (test_vllm_mxfp4.py compares them)")
def test_gpt_oss_mxfp4_is_one_line_where_vllm_cpu_has_no_mxfp4_kernel():
    """gpt-oss as openai ships it (MXFP4 ``_blocks``/``_scales`` experts, ``quant_method: mxfp4``, bf16):
    plain vLLM 0.32's CPU build runs MXFP4 MoE only with its AMX kernel (``CPUExpertsMxfp4``), so on a
    CPU without AMX it refuses the model; with k3d the plugin refuses it first, in one line naming
    vLLM, AMX and the family, while the model is built (after the daemon check, before any weight is read)."""
    path = checkpoint("gpt_oss_mxfp4")
    rc, last, err = run_engine_script(path, None, dtype="bfloat16")
    assert rc != 0
    assert "NotImplementedError: No MXFP4 MoE backend supports the deployment configuration" in last, err[-3000:]
    assert "backend: CPU, reason: kernel does not support current device cpu" in last
    d = spawn_daemon(path, "--arena", "8MiB")
    try:
        rc, last, err = run_engine_script(path, {"endpoint": d.endpoint}, dtype="bfloat16")
    finally:
        d.stop()
    assert rc != 0
    assert "FamilyError" in last and "'gpt_oss'" in last and "MXFP4" in last and "AMX" in last, err[-3000:]
    assert "plain vLLM 0.32" in last and "no AMX" in last
    assert "gpt-oss bf16" in last                  # what it does compute


def test_compile_on_a_cpu_engine_is_one_line_before_any_weight_is_read():
    """Issue 33: vLLM's CPU build compiles by default (``DYNAMO_TRACE_ONCE``), which would trace
    into the k3d client; without ``enforce_eager`` the plugin refuses in one line, before it
    connects (the endpoint here has no daemon) and before any weight is read."""
    path = checkpoint("qwen3_moe", split=True)
    shards = [os.path.join(path, n) for n in ("rest.safetensors", "experts.safetensors")]
    for s in shards:
        _drop_cache(s)
    rc, last, err = run_engine_script(path, {"endpoint": f"ipc://{SCRATCH}/vllm-none.sock"}, enforce_eager=False)
    assert rc != 0
    assert "torch.compile (DYNAMO_TRACE_ONCE)" in last and "enforce_eager=True" in last, err[-3000:]
    for s in shards:
        assert _resident_pages(s, 0)[0] == 0, f"{s} was read before the refusal"


# what vllm#53153 fixes: a vLLM whose model code builds its layers from a registry the plugin's
# register_oot did not write (the hardware-agnostic layers under VLLM_USE_HW_AGNOSTIC=1); vLLM
# 0.32 reads the in-tree registry for RoutedExperts, so the bypass is made here the way such a
# vLLM behaves: the plugin registers, and the registry vLLM builds from has no entry for it
BYPASS = ("from vllm.plugins import load_general_plugins\n"
          "load_general_plugins()\n"
          "from vllm.model_executor.custom_op import op_registry_oot\n"
          "from k3client.vllm.experts import REPLACED\n"
          "for name in REPLACED:\n"
          "    op_registry_oot.pop(name)\n")


def test_bypassed_experts_registration_is_one_line_before_weights_load():
    path = checkpoint("qwen3_moe")
    d = spawn_daemon(path, "--arena", "8MiB")
    try:
        rc, last, err = run_engine_script(path, {"endpoint": d.endpoint}, prelude=BYPASS,
                                          env={"VLLM_USE_HW_AGNOSTIC": "1"})
    finally:
        d.stop()
    assert rc != 0
    assert "vLLM built its own RoutedExperts" in last and "VLLM_USE_HW_AGNOSTIC=1" in last, err[-3000:]
    assert "vllm#53153" in last
    assert "Loading weights took" not in err           # DefaultModelLoader's line after load_weights
