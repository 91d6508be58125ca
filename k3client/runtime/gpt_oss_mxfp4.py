"""gpt-oss's MXFP4 experts, as openai ships them, computed from the daemon's views the way vLLM's CPU kernel does.

``compute.fused`` (vLLM's numerics) computes a quantized ``GptOss`` layer's experts with
``expert``; the vLLM plugin accepts such a model only where plain vLLM runs it
(``k3client.vllm.experts._quantized``).  Imports no engine.

vLLM 0.32 runs an MXFP4 gpt-oss on a CPU only with ``CPUExpertsMxfp4``
(``fused_experts_cpu`` with ``CPUQuantMethod.MXFP4``: weight-only W4A16 on AMX
tiles; elsewhere plain vLLM refuses the model, and so does the plugin).  That
kernel takes the checkpoint's bytes as they are (``prepare_mxfp4_moe_layer_for_cpu``
only repacks them into tiles), the biases as float32, and vLLM's gpt-oss swiglu
(``gemm1_alpha`` 1.702, ``gemm1_beta`` 1, ``swiglu_limit`` 7).

Views of one expert (the daemon's layout names; G = H / 32 blocks per row)::

    gate_up_proj_blocks  U8   [2I, H/32, 16]   rows interleave gate and up: row 2j is gate j, 2j+1 up j
    gate_up_proj_scales  U8   [2I, H/32]       E8M0, one per 32 values of a row
    gate_up_proj_bias    BF16 [2I]             interleaved alike
    down_proj_blocks     U8   [H, I/32, 16]
    down_proj_scales     U8   [H, I/32]
    down_proj_bias       BF16 [H]

The math (``expert``), per expert on its rows ``x``:
``g = x W13^T + b13`` with ``W13 = dequantize(gate_up_proj) [2I, H]`` (MXFP4's
``[out, in]`` rows are ``F.linear``'s layout: no transpose, no copy beyond the
dequantized weight); ``gate = g[:, 0::2].clamp(max=limit)``, ``up = g[:, 1::2]
.clamp(-limit, limit)``; ``h = (up + 1) * gate * sigmoid(alpha * gate)``, rounded to the
engine's dtype where the kernel stores its bf16 intermediate; ``out = h W2^T + b2``.
Every MXFP4 value (an FP4 value times a power of two) is exact in bf16 and float32, so
dequantizing to float32 and multiplying in float32 is the kernel's bf16-by-bf16 products
with float32 accumulation, up to summation order.  The result is float32 [rows, H] for
the caller to weight and sum.

Pure functions of their inputs (torch ops only; any thread); views are never written.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import mxfp4

NAMES = ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias",
         "down_proj_blocks", "down_proj_scales", "down_proj_bias")


def weight(views: dict, proj: str) -> torch.Tensor:
    """``proj``'s (``gate_up_proj`` or ``down_proj``) dequantized float32 ``[out, in]`` weight."""
    return mxfp4.dequantize(views[f"{proj}_blocks"], views[f"{proj}_scales"], layout="gpt-oss",
                            name=proj, dtype=torch.float32)


def expert(math, views: dict, x: torch.Tensor, device, dtype: torch.dtype) -> torch.Tensor:
    """One expert on its rows ``x`` (the engine's ``dtype``), float32 ``[rows, H]``; ``math`` gives
    ``alpha`` and ``limit`` (``experts._Math``)."""
    xf = x if x.dtype == torch.float32 else x.float()
    g = F.linear(xf, weight(views, "gate_up_proj"), views["gate_up_proj_bias"].float())
    gate = g[..., 0::2].clamp(max=math.limit)
    up = g[..., 1::2].clamp(min=-math.limit, max=math.limit)
    h = (up + 1) * (gate * torch.sigmoid(gate * math.alpha))
    if dtype != torch.float32:
        h = h.to(dtype).float()          # the kernel's intermediate is stored in the activation dtype
    return F.linear(h, weight(views, "down_proj"), views["down_proj_bias"].float())
