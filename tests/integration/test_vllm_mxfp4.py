"""gpt-oss in MXFP4 as openai ships it, computed by the vLLM plugin from the daemon's views.

Plain vLLM 0.32 computes MXFP4 MoE on a CPU only with ``CPUExpertsMxfp4`` (AMX tiles), so
the engine comparison (plain vLLM against k3d, one step's log-probabilities within the
bf16 tolerance) runs on AMX CPUs and skips elsewhere in one line.  The plugin's expert
math runs on every CPU: a real ``k3d start`` serves a tiny MXFP4 checkpoint, and
``gpt_oss_mxfp4.expert`` on its views equals a reference written from the checkpoint's
bytes (``tests/mxfp4_reference``'s element-by-element decoding, float64 gemms, vLLM's own
``SwigluOAIAndMul.forward_native`` for the activation).
"""

import numpy as np
import pytest
from test_vllm_exact import BF16_TOL, _logprobs_close
from vllm_common import (  # noqa: F401 -- the autouse fixture
    _vllm_ipc_files,
    checkpoint,
    engine,
    expert_params,
    first_logprobs,
    plain_engine,
    stats,
)

import k3client
from conftest import spawn_daemon
from k3client import cpu
from k3client.vllm import gpt_oss_mxfp4
from mxfp4_reference import ocp_reference

pytestmark = pytest.mark.vllm
torch = pytest.importorskip("torch")

ALPHA, LIMIT = 1.702, 7.0           # vLLM's gpt-oss MXFP4 config: gemm1_alpha, swiglu_limit
LAYER, EXPERTS = 1, (0, 3)


class _Math:
    alpha, limit = ALPHA, LIMIT


def _checkpoint_expert(path: str, layer: int, e: int) -> dict:
    """Expert ``e`` of ``layer`` read from the checkpoint file itself (not the daemon): numpy arrays."""
    from safetensors import safe_open

    out = {}
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        for name in gpt_oss_mxfp4.NAMES:
            out[name] = f.get_tensor(f"model.layers.{layer}.mlp.experts.{name}")[e]
    return out


def _dequant_reference(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """``[out, G, 16]`` gpt-oss blocks -> ``[out, 32 G]`` float64, element by element from the OCP spec."""
    packed = blocks.numpy().reshape(blocks.shape[0], -1)
    return ocp_reference(packed, scales.numpy()).astype(np.float64)


def _vllm_formula(w: dict, x: torch.Tensor, round_to=None) -> np.ndarray:
    """What vLLM's CPU MXFP4 MoE computes for one expert: W4A16 gemms on the dequantized weights, its
    swigluoai on interleaved gate/up (``SwigluOAIAndMul.forward_native``), the intermediate stored in
    ``round_to`` (bf16 in a bf16 engine), float32 biases."""
    from vllm.model_executor.layers.activation import SwigluOAIAndMul

    w13 = _dequant_reference(w["gate_up_proj_blocks"], w["gate_up_proj_scales"])
    w2 = _dequant_reference(w["down_proj_blocks"], w["down_proj_scales"])
    xs = x.double().numpy()
    g = xs @ w13.T + w["gate_up_proj_bias"].double().numpy()
    h = SwigluOAIAndMul.forward_native(_Math(), torch.from_numpy(g))
    if round_to is not None:
        h = h.to(round_to).double()
    return h.numpy() @ w2.T + w["down_proj_bias"].double().numpy()


def test_mxfp4_expert_math_on_daemon_views_equals_vllms_formula():
    """Runs on every CPU (no engine): the daemon's views of a served MXFP4 gpt-oss, through the
    plugin's expert math, in a float32 engine (to float32 rounding) and a bf16 one (within bf16's)."""
    path = checkpoint("gpt_oss_mxfp4")
    d = spawn_daemon(path, "--arena", "8MiB")
    try:
        with k3client.connect(d.endpoint) as c:
            names = {s.name for s in c.layout_of(LAYER)}
            assert set(gpt_oss_mxfp4.NAMES) <= names, names
            g = torch.Generator().manual_seed(0)
            for ex in c.fetch(LAYER, list(EXPERTS)):
                views = {n: ex.tensor(n) for n in gpt_oss_mxfp4.NAMES}
                ref_w = _checkpoint_expert(path, LAYER, ex.expert)
                x = torch.randn(3, ref_w["down_proj_bias"].shape[0], generator=g)
                got = gpt_oss_mxfp4.expert(_Math(), views, x, torch.device("cpu"), torch.float32)
                want = _vllm_formula(ref_w, x)
                scale = np.abs(want).max()
                assert got.dtype == torch.float32 and got.shape == want.shape
                assert scale > 0 and np.abs(got.double().numpy() - want).max() <= 1e-5 * scale
                xb = x.to(torch.bfloat16)
                got = gpt_oss_mxfp4.expert(_Math(), views, xb, torch.device("cpu"), torch.bfloat16)
                want = _vllm_formula(ref_w, xb, round_to=torch.bfloat16)
                assert np.abs(got.double().numpy() - want).max() <= 1e-2 * np.abs(want).max()
                # the interleave matters: gate and up swapped is far off
                swapped = {**ref_w, "gate_up_proj_blocks": _swap_rows(ref_w["gate_up_proj_blocks"]),
                           "gate_up_proj_scales": _swap_rows(ref_w["gate_up_proj_scales"]),
                           "gate_up_proj_bias": _swap_rows(ref_w["gate_up_proj_bias"])}
                assert np.abs(_vllm_formula(swapped, x) - _vllm_formula(ref_w, x)).max() > 1e-2 * scale
    finally:
        d.stop()


def _swap_rows(t: torch.Tensor) -> torch.Tensor:
    """Rows 2j and 2j+1 exchanged (gate and up of each pair)."""
    return t.reshape(t.shape[0] // 2, 2, *t.shape[1:]).flip(1).reshape(t.shape)


@pytest.mark.skipif(not cpu.facts().amx, reason=f"no AMX ({cpu.facts().describe()}): vLLM 0.32's CPU MXFP4 MoE "
                    "(CPUExpertsMxfp4) needs AMX tiles, so plain vLLM cannot run the reference")
def test_gpt_oss_mxfp4_logprobs_equal_plain_vllm_on_amx():
    """gpt-oss as shipped (MXFP4 experts, bf16 engine): plain vLLM's AMX kernel against the plugin's
    dequantized experts, one step's top-5 log-probabilities within ``BF16_TOL``; no expert parameter
    in the k3d engine."""
    path = checkpoint("gpt_oss_mxfp4")
    with plain_engine(path, dtype="bfloat16") as llm:
        want = first_logprobs(llm)
    d = spawn_daemon(path, "--arena", "8MiB")
    try:
        with engine(path, k3d={"endpoint": d.endpoint}, dtype="bfloat16") as llm:
            got = first_logprobs(llm)
            st = stats(llm)
            (params,) = llm.apply_model(expert_params)
    finally:
        d.stop()
    assert params == [] and st["experts_fetched"] > 0
    _logprobs_close(want, got, BF16_TOL)
