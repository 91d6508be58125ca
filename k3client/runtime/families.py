"""The math of a family's experts, computed from the daemon's zero-copy views.

Each family's eager experts loop (transformers 5, ``@use_experts_implementation``)
walks the hit experts in ascending order and accumulates ``index_add_`` into a
zeroed output.  ``Family.compute`` is the body of that loop for ONE expert
(``output``, then its ``index_add_``), with the weights taken from the arena
instead of the module's stacked parameter, in the same operations and dtypes,
so the logits equal ``experts_implementation="eager"`` bit for bit on CPU:

- ``Standard`` (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, GraniteMoE):
  ``gate, up = linear(x, gate_up).chunk(2)``; ``act(gate) * up``; ``linear(., down)``;
  times the routing weight.  On disk the gate and up halves are two tensors
  (``w1``/``w3``, ``gate_proj``/``up_proj``) or one (``input_linear.weight``).  The
  views (``views.views``) are ``(gate_up, down)`` where one view covers both halves
  (a fused tensor, or two lying back to back in the slot: ``Expert.stacked``, eager's
  own single ``linear``), else ``(gate, up, down)``: two ``linear`` calls on the
  halves give the same bits as one on the concatenation (checked by the tests), so
  nothing is concatenated.
- ``GptOss``: transposed weights with biases, interleaved gate/up and the clamped
  SwiGLU of the module's own ``_apply_gate``; views are ``{name: view}``.  MXFP4
  ``_blocks``/``_scales`` are dequantized per expert exactly as transformers'
  dequantizing loader does (values, then ``.T.contiguous()``), a copy the size of
  one bf16 expert.

``layout names -> roles`` come from the daemon's layout (what the checkpoint calls
each tensor); names that are no known layout are a ``FamilyError`` naming them.
Pure functions of their inputs; any thread, torch ops only (no engine import).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import mxfp4

# (gate, up, down) names of per-expert checkpoints; (gate_up, down) of stacked ones
SPLIT_NAMES = (("gate_proj.weight", "up_proj.weight", "down_proj.weight"),
               ("w1.weight", "w3.weight", "w2.weight"))
FUSED_NAMES = (("input_linear.weight", "output_linear.weight"), ("gate_up_proj", "down_proj"))


class FamilyError(Exception):
    """The checkpoint's experts cannot be computed here; one line naming what and why."""


class Standard:
    """Gated MLP experts stored like Mixtral's ``gate_up_proj [E, 2I, H]`` / ``down_proj``."""

    name = "standard"

    def __init__(self, names: set[str]):
        for gate, up, down in SPLIT_NAMES:
            if {gate, up, down} <= names:
                self.gate, self.up, self.gate_up, self.down = gate, up, None, down
                return
        for gate_up, down in FUSED_NAMES:
            if {gate_up, down} <= names:
                self.gate = self.up = None
                self.gate_up, self.down = gate_up, down
                return
        raise FamilyError(f"expert tensors {sorted(names)} are not a known gated-MLP layout "
                          f"(gate/up/down as {[n[:3] for n in SPLIT_NAMES]} or fused {list(FUSED_NAMES)})")

    def weights(self, module, views: tuple, device, dtype) -> tuple:
        """``views`` (``(gate_up, down)`` or ``(gate, up, down)``) on ``device`` in ``dtype``."""
        return tuple(on(v, device, dtype) for v in views)

    def compute(self, module, w: tuple, x, token_idx, top_k_pos, top_k_weights, out) -> None:
        """One expert of the eager loop: ``out.index_add_`` of its weighted output."""
        out.index_add_(0, token_idx, self.output(module, w, x, token_idx, top_k_pos, top_k_weights).to(out.dtype))

    def output(self, module, w: tuple, x, token_idx, top_k_pos, top_k_weights):
        """One expert's weighted output, before ``compute`` adds it (the runtime adds
        outputs computed out of order in eager's order itself: ``compute.InOrder``)."""
        if len(w) == 3:
            gate, up, down = F.linear(x, w[0]), F.linear(x, w[1]), w[2]
        else:
            (gate, up), down = F.linear(x, w[0]).chunk(2, dim=-1), w[1]
        h = module.act_fn(gate) * up
        h = F.linear(h, down)
        return h * top_k_weights[token_idx, top_k_pos, None]


class GptOss:
    """gpt-oss: ``x @ gate_up [H, 2I] + b``, interleaved clamped SwiGLU, ``@ down [I, H] + b``."""

    name = "gpt_oss"
    NAMES = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    MXFP4 = ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias",
             "down_proj_blocks", "down_proj_scales", "down_proj_bias")

    def __init__(self, names: set[str]):
        if set(self.NAMES) <= names:
            self.quantized = False
        elif set(self.MXFP4) <= names:
            self.quantized = True
        else:
            raise FamilyError(f"gpt-oss expert tensors {sorted(names)}: need {list(self.NAMES)} (bf16) "
                              f"or {list(self.MXFP4)} (MXFP4 as shipped)")

    def weights(self, module, views: dict, device, dtype) -> tuple:
        if not self.quantized:
            return tuple(on(views[n], device, dtype) for n in self.NAMES)
        return (dequant(views, "gate_up_proj", device, dtype), on(views["gate_up_proj_bias"], device, dtype),
                dequant(views, "down_proj", device, dtype), on(views["down_proj_bias"], device, dtype))

    def compute(self, module, w: tuple, x, token_idx, top_k_pos, top_k_weights, out) -> None:
        out.index_add_(0, token_idx, self.output(module, w, x, token_idx, top_k_pos, top_k_weights).to(out.dtype))

    def output(self, module, w: tuple, x, token_idx, top_k_pos, top_k_weights):
        gate_up_w, gate_up_b, down_w, down_b = w
        gate_up = x @ gate_up_w + gate_up_b
        gated = module._apply_gate(gate_up)
        h = gated @ down_w + down_b
        return h * top_k_weights[token_idx, top_k_pos, None]


def on(t, device, dtype):
    """A view as the module would hold it: on its device, in its dtype (no copy when both match)."""
    if t.device != device:
        t = t.to(device, non_blocking=True)   # from pinned (cudaHostRegister'ed) arena memory
    return t if t.dtype == dtype else t.to(dtype)


def dequant(views: dict, proj: str, device, dtype):
    """``[out, G, 16]`` blocks + ``[out, G]`` scales -> ``[in, out]``, as transformers' loader lays it out."""
    blocks, scales = views[f"{proj}_blocks"], views[f"{proj}_scales"]
    blocks, scales = on(blocks, device, blocks.dtype), on(scales, device, scales.dtype)
    w = mxfp4.dequantize(blocks.reshape(blocks.shape[0], -1), scales, name=proj, dtype=torch.float32)
    return w.to(dtype).T.contiguous()
