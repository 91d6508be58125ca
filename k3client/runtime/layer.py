"""``Layer``: what an engine gives the runtime about one MoE layer.

An adapter builds one ``Layer`` per MoE layer at load and never changes it after
``Runtime.__init__`` links them (``next``).  ``module`` is whatever the family's math
reads: a transformers experts module (``act_fn``, ``_apply_gate``, ``num_experts``)
or, for an engine whose experts module holds no such thing, an ``Activation``.
``top_k`` says how the next layer's router answers gate-ahead: None, the router
returns the expert indices itself (transformers); an int, it returns logits whose
top ``top_k`` are the experts (vLLM).  ``specs`` is the daemon's layout of the
layer; ``fused`` (derived from it) says the gate and up tensors lie back to back in
a slot, so one view covers both (``views.views``).  ``rowmajor``: the adapter's
native kernel can read this layer's views (False: computed with torch).

On one rank of a multi-rank engine: ``shard`` slices each expert's views to the rank's
tensor-parallel part (an object with ``of(views) -> views``, zero-copy: e.g.
``k3client.vllm.ranks.Shard``; ``views.views`` applies it), and ``mine`` is the set of
expert ids the rank computes under expert parallelism (``compute.fused`` skips the
others' pairs; gate-ahead predicts only these).  None: the whole expert, every expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .families import GptOss

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}
# vLLM's SwigluOAIAndMul defaults: gpt-oss's MoE config leaves swiglu_alpha/limit unset and its
# CPU kernel uses these
OAI_ALPHA, OAI_LIMIT = 1.702, 7.0


class Activation:
    """The part of an experts module the math reads, for an engine that has no such module:
    the expert count and the activation (gated SiLU/GELU: ``act_fn``; gpt-oss: ``alpha``/``limit``
    of its clamped SwiGLU)."""

    def __init__(self, num_experts: int, activation: str, moe_config=None):
        self.num_experts = num_experts
        self.activation = activation            # its name, for a native kernel that calls it itself
        self.act_fn = ACTIVATIONS.get(activation)
        self.alpha = getattr(moe_config, "swiglu_alpha", None) or OAI_ALPHA
        self.limit = getattr(moe_config, "swiglu_limit", None) or OAI_LIMIT


@dataclass
class Layer:
    layer: int
    module: object                  # the experts module, or an Activation
    router: object | None           # its block's router (for gate-ahead of the layer before)
    family: object                  # families.Standard / GptOss
    names: tuple                    # layout names, for the views
    dtype: torch.dtype              # the dtype the engine would hold the weights in
    top_k: int | None = None        # None: the router returns indices; else logits, top_k of them
    specs: tuple = ()               # the daemon's layout of this layer (TensorSpec)
    rowmajor: bool = False          # the native kernel reads these views
    next: int | None = None         # next MoE layer (set by the Runtime)
    fused: bool = False             # gate and up back to back in a slot (from specs)
    shard: object | None = None     # a tensor-parallel rank's slicing of the views (module docstring)
    mine: frozenset | None = None   # an expert-parallel rank's expert ids

    def __post_init__(self):
        self.specs = tuple(self.specs)
        self.fused = back_to_back(self.specs, self.family)
        self._mine_masks = {}

    def mine_mask(self, device):
        """``mine`` as a boolean tensor over the expert ids, on ``device`` (made once per device)."""
        m = self._mine_masks.get(device)
        if m is None:
            m = torch.zeros(self.module.num_experts, dtype=torch.bool)
            m[sorted(self.mine)] = True
            m = self._mine_masks[device] = m.to(device)
        return m


def back_to_back(specs, family) -> bool:
    """True when ``family``'s gate and up tensors lie back to back in the layout with one dtype and
    trailing shape (``Expert.stacked``'s condition), so one view covers both."""
    if isinstance(family, GptOss) or getattr(family, "gate", None) is None:
        return False
    by = {s.name: s for s in specs}
    g, u = by.get(family.gate), by.get(family.up)
    return (g is not None and u is not None and u.offset == g.offset + g.nbytes and g.dtype == u.dtype
            and tuple(g.shape[1:]) == tuple(u.shape[1:]))
