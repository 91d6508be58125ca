"""Per-family expert math, computed from the daemon's zero-copy views.

Each family's experts module (transformers 5, ``@use_experts_implementation``)
has an eager ``forward`` that loops over the hit experts in ascending order and
accumulates ``index_add_`` into a zeroed output.  ``Family.compute`` is the
body of that loop for ONE expert (``output``, then its ``index_add_``), with the weights taken from the arena instead
of the module's stacked parameter, in the same operations and the same dtypes,
so the logits equal ``experts_implementation="eager"`` bit for bit on CPU:

- ``standard`` (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, GraniteMoE):
  ``gate, up = linear(x, gate_up).chunk(2)``; ``act(gate) * up``; ``linear(., down)``;
  times the routing weight.  On disk the gate and up halves are two tensors
  (``w1``/``w3``, ``gate_proj``/``up_proj``) or one (``input_linear.weight``).  Where
  the layout puts the two halves back to back, the runtime passes one view of both
  (``Expert.stacked``, under ``STACKED``): eager's own single ``linear``, one call
  fewer per expert.  Elsewhere two ``linear`` calls on the halves give the same bits
  as one on the concatenation (checked by the tests), so nothing is concatenated.
- ``gpt_oss``: transposed weights with biases, interleaved gate/up and the
  clamped SwiGLU of the module's own ``_apply_gate``; MXFP4 ``_blocks``/``_scales``
  are dequantized per expert exactly as transformers' dequantizing loader does
  (values, then ``.T.contiguous()``), a copy the size of one bf16 expert.

``layout names -> roles`` come from the daemon's layout (what the checkpoint
calls each tensor); a family whose names are not recognised is an error naming
them.  Pure functions of their inputs; any thread, but torch ops only.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

from .. import mxfp4

# (gate, up, down) names of per-expert checkpoints; (gate_up, down) of stacked ones
SPLIT_NAMES = (("gate_proj.weight", "up_proj.weight", "down_proj.weight"),
               ("w1.weight", "w3.weight", "w2.weight"))
FUSED_NAMES = (("input_linear.weight", "output_linear.weight"), ("gate_up_proj", "down_proj"))
STACKED = "gate|up"         # a view key: the gate and up halves as one view (no checkpoint has it)


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

    def weights(self, module, views: dict, device, dtype) -> tuple:
        if STACKED in views:
            names = (STACKED, self.down)
        elif self.gate_up is None:
            names = (self.gate, self.up, self.down)
        else:
            names = (self.gate_up, self.down)
        return tuple(_on(views[n], device, dtype) for n in names)

    def compute(self, module, w: tuple, x, token_idx, top_k_pos, top_k_weights, out) -> None:
        """One expert of the eager loop: ``out.index_add_`` of its weighted output."""
        out.index_add_(0, token_idx, self.output(module, w, x, token_idx, top_k_pos, top_k_weights).to(out.dtype))

    def output(self, module, w: tuple, x, token_idx, top_k_pos, top_k_weights):
        """One expert's weighted output, before ``compute`` adds it (the runtime adds
        outputs computed out of order in eager's order itself)."""
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
            return tuple(_on(views[n], device, dtype) for n in self.NAMES)
        return (_dequant(views, "gate_up_proj", device, dtype), _on(views["gate_up_proj_bias"], device, dtype),
                _dequant(views, "down_proj", device, dtype), _on(views["down_proj_bias"], device, dtype))

    def compute(self, module, w: tuple, x, token_idx, top_k_pos, top_k_weights, out) -> None:
        out.index_add_(0, token_idx, self.output(module, w, x, token_idx, top_k_pos, top_k_weights).to(out.dtype))

    def output(self, module, w: tuple, x, token_idx, top_k_pos, top_k_weights):
        gate_up_w, gate_up_b, down_w, down_b = w
        gate_up = x @ gate_up_w + gate_up_b
        gated = module._apply_gate(gate_up)
        h = gated @ down_w + down_b
        return h * top_k_weights[token_idx, top_k_pos, None]


def _on(t, device, dtype):
    """A view as the module would hold it: on its device, in its dtype (no copy when both match)."""
    if t.device != device:
        t = t.to(device, non_blocking=True)   # from pinned (cudaHostRegister'ed) arena memory
    return t if t.dtype == dtype else t.to(dtype)


def _dequant(views: dict, proj: str, device, dtype):
    """``[out, G, 16]`` blocks + ``[out, G]`` scales -> ``[in, out]``, as transformers' loader lays it out."""
    blocks, scales = views[f"{proj}_blocks"], views[f"{proj}_scales"]
    blocks, scales = _on(blocks, device, blocks.dtype), _on(scales, device, scales.dtype)
    w = mxfp4.dequantize(blocks.reshape(blocks.shape[0], -1), scales, name=proj, dtype=torch.float32)
    return w.to(dtype).T.contiguous()


# experts class -> math; the families the tests compute against eager, bit for bit
FAMILIES = {
    "MixtralExperts": ("Mixtral", Standard),
    "Qwen2MoeExperts": ("Qwen2-MoE", Standard),
    "Qwen3MoeExperts": ("Qwen3-MoE", Standard),
    "DeepseekV3Experts": ("DeepSeek-V3", Standard),
    "GraniteMoeExperts": ("GraniteMoE", Standard),
    "GptOssExperts": ("gpt-oss", GptOss),
}


def supported() -> str:
    return (", ".join(sorted(v[0] for v in FAMILIES.values()))
            + ", and any family whose experts module runs Mixtral's eager loop unchanged")


def _loop_source(cls) -> str | None:
    """The eager forward's code, without comments, blank lines and its ``def`` line."""
    fn = getattr(cls.forward, "__wrapped__", None)
    try:
        src = inspect.getsource(fn) if fn is not None else None
    except (OSError, TypeError):
        return None
    if src is None:
        return None
    lines = [ln.strip() for ln in src.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    body = "\n".join(lines)
    return body[body.index(") -> torch.Tensor:"):] if ") -> torch.Tensor:" in body else None


@functools.cache
def _standard_loop() -> str | None:
    from transformers.models.mixtral.modeling_mixtral import (
        MixtralExperts,  # the reference loop
    )

    return _loop_source(MixtralExperts)


def runs_standard_loop(module) -> bool:
    """True when the module's eager forward is Mixtral's loop, flags included (gated, fused, no bias)."""
    if not (module.has_gate and module.is_concatenated and not module.is_transposed and not module.has_bias
            and not getattr(module, "has_post_expert_norm", False)):
        return False
    ref = _standard_loop()
    return ref is not None and _loop_source(type(module)) == ref


def family_for(experts_module, model_type: str, names: set[str]):
    """The math for ``experts_module`` given the daemon's layout names, or FamilyError."""
    cls = type(experts_module).__name__
    entry = FAMILIES.get(cls)
    if entry is None and runs_standard_loop(experts_module):
        entry = (model_type, Standard)
    if entry is None:
        raise FamilyError(f"k3client.hf cannot compute the experts of model type {model_type!r} ({cls}); "
                          f"supported families: {supported()}")
    try:
        return entry[1](names)
    except FamilyError as e:
        raise FamilyError(f"{entry[0]}: {e}") from None
