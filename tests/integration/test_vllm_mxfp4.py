"""gpt-oss in MXFP4 as openai ships it, computed by the vLLM plugin from the daemon's views.

Plain vLLM 0.32 computes MXFP4 MoE on a CPU only with ``CPUExpertsMxfp4`` (AMX tiles), so
the engine comparison (plain vLLM against k3d, one step's log-probabilities within the
bf16 tolerance) runs on AMX CPUs and skips elsewhere in one line.  Two tests run on every CPU:

- the expert math: a real ``k3d start`` serves a tiny MXFP4 checkpoint, and
  ``gpt_oss_mxfp4.expert`` on its views equals a reference written from the checkpoint's
  bytes (``tests/mxfp4_reference``'s element-by-element decoding, float64 gemms, vLLM's own
  ``SwigluOAIAndMul.forward_native`` for the activation);
- the engine path: the k3d engine on the MXFP4 checkpoint, built in a fresh Python whose
  ``k3client.cpu.facts`` reports AMX (the only thing faked: the plugin's refusal is then
  lifted; its compute does not depend on the CPU), against plain vLLM in bf16 on the
  checkpoint's dequantized bf16 copy, the same W4A16 math (MXFP4 values are exact in bf16).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from test_vllm_exact import BF16_TOL
from vllm_common import (  # noqa: F401 -- the autouse fixture
    KV_BYTES,
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
from k3client.runtime import gpt_oss_mxfp4
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
    _logprobs_near(want, got, BF16_TOL)


def _logprobs_near(want, got, tol):
    """Per prompt: at least 4 of the top 5 shared, each within ``tol`` nats, and each side's top token
    within ``tol`` of the other's best (this random model's top tokens tie at bf16's resolution)."""
    for w, g in zip(want, got, strict=True):
        common = set(w) & set(g)
        assert len(common) >= 4, (w, g)
        assert max(abs(w[t] - g[t]) for t in common) <= tol, (w, g)
        for a, b in ((w, g), (g, w)):
            top = max(a, key=a.get)
            assert top in b and max(b.values()) - b[top] <= tol, (w, g)


def _dequantized_copy(src: str, out: str) -> str:
    """``src`` (gpt-oss, MXFP4 experts) with its experts dequantized to bf16 in transformers' layout
    (``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``) and no quantization_config."""
    import shutil

    from safetensors.torch import load_file, save_file

    from k3client import mxfp4

    shutil.copytree(src, out)
    path = os.path.join(out, "model.safetensors")
    t = load_file(path)
    for key in [k for k in t if k.endswith("_blocks")]:
        base = key[:-len("_blocks")]
        w = mxfp4.dequantize(t.pop(key), t.pop(base + "_scales"), layout="gpt-oss", dtype=torch.float32)
        t[base] = w.transpose(1, 2).contiguous().to(torch.bfloat16)      # [E, out, in] -> [E, in, out]: exact
    save_file(t, path, metadata={"format": "pt"})
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    del cfg["quantization_config"]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return out


# the k3d engine in a fresh Python: in-process engine core, the plugin's CPU facts reporting AMX
_K3D_AMX_ASSUMED = """
import json, sys
import k3client.cpu
amx = k3client.cpu.from_flags("avx512f avx512_bf16 amx_tile amx_bf16 amx_int8")
k3client.cpu.facts = lambda: amx
from vllm import LLM, SamplingParams
path, endpoint, prompts, kv = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
llm = LLM(model=path, enforce_eager=True, kv_cache_memory_bytes=kv, skip_tokenizer_init=True, dtype="bfloat16",
          max_model_len=128, max_num_seqs=4, seed=0, additional_config={"k3d": {"endpoint": endpoint}})
sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
from k3client.vllm import stats
(st,) = llm.apply_model(stats)
print(json.dumps({"logprobs": [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs],
                  "experts_fetched": st["experts_fetched"]}))
"""


def test_gpt_oss_mxfp4_engine_equals_plain_vllm_on_the_dequantized_copy(tmp_path):
    """Every CPU: the plugin's MXFP4 path through a real vLLM engine (loader, layout, views, routing,
    dequantized experts) gives plain vLLM's bf16 log-probabilities on the dequantized checkpoint."""
    from vllm_common import PROMPTS

    path = checkpoint("gpt_oss_mxfp4")
    copy = _dequantized_copy(path, str(tmp_path / "bf16"))
    with plain_engine(copy, dtype="bfloat16") as llm:
        want = first_logprobs(llm)
    d = spawn_daemon(path, "--arena", "8MiB")
    try:
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
        r = subprocess.run([sys.executable, "-c", _K3D_AMX_ASSUMED, path, d.endpoint, json.dumps(PROMPTS),
                            str(KV_BYTES)], env=env, capture_output=True, text=True, timeout=300, check=False)
    finally:
        d.stop()
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    got = [{int(t): v for t, v in lp.items()} for lp in out["logprobs"]]
    assert out["experts_fetched"] > 0
    _logprobs_near(want, got, BF16_TOL)
