"""A layer's compute over fetched views: three loops, each matching one engine's numerics.

Each loop takes the runtime (its ``_groups``, ``gpu``, ``ahead``, ``stats``) and one
layer call (hidden states, top-k indices and weights), scores and sends gate-ahead
(``gate_ahead``), fetches the union of routed experts in ascending order and returns
the layer's output.  Where the compute of the layer is complete is the runtime's
(``Runtime._layer_done``), after the loop returns.

- ``eager_loop`` (transformers on a CPU, ``numerics="eager"``): the experts module's
  eager loop: per expert ``torch.where`` of its tokens, ``family.output``, added to the
  output in ascending expert order (``InOrder``: eager's summation order, so the
  logits are eager's bits) while experts are computed as they arrive (``fetch_iter``).
- ``sorted_loop`` (transformers on a CUDA device): the same order from one stable sort
  per layer (one device-to-host read of the counts instead of one ``torch.where``
  sync per expert), groups staged on the copy stream, so later copies overlap compute.
- ``fused`` (vLLM, ``numerics="fused"``): the step's (token, expert) pairs sorted by
  expert once (stable), the tokens' rows gathered once, each expert computed on its
  contiguous run of rows (``gated_expert``/``gpt_oss_expert``, gpt-oss's MXFP4:
  ``gpt_oss_mxfp4.expert``; the runtime's ``native`` kernel or torch with or without
  oneDNN per run, as ``dispatch.kernels`` decides for the CPU, dtype and layer),
  scaled by the routing weights in place and summed per token in ascending expert
  order once all are in (one ``index_add_``, or ``add_``s for one token), so the bits do
  not depend on arrival.  A decode step (at most ``SMALL_STEP`` pairs) is sorted in
  Python on one ``tolist``: argsort, bincount and gathers cost more at that size.
  With the native kernel the weighted outputs are summed in float32 and rounded once,
  where vLLM's fused kernel rounds them.  A decode step whose experts all go to the
  native kernel, where the runtime has ``native_layer``, is computed in one native
  call per group (``_one_call``): the same bits, no Python between experts.  Its
  groups come whole (``client.fetch``): the fused call needs every view of a group
  at once, so a miss delays the group's hits too, where ``as_ready`` would compute
  them during the read; measured here, ``as_ready`` saved nothing visible
  (bench/README.md, "as_ready.py"), and a resident decode step is answered whole.
  Invariant: ``torch.backends.mkldnn.enabled`` is as the caller left it when ``fused``
  returns or raises.

Owner: the model's thread.
"""

from __future__ import annotations

import itertools
from collections import Counter

import torch
import torch.nn.functional as F

from .. import cpu
from . import dispatch, gpt_oss_mxfp4
from .families import GptOss, on

# (token, expert) pairs of a step up to which fused sorts them in Python (a decode step)
SMALL_STEP = 64


class InOrder:
    """Expert outputs computed in any order, added to ``out`` in the order of ``experts``
    (eager's ascending loop): each ``index_add_`` happens as soon as every expert before it
    has been added, so the summation order, hence every bit, is eager's; an output waits
    here only while an expert before it is still being read."""

    def __init__(self, out, experts: list[int]):
        self.out, self.order, self.next, self.held = out, experts, 0, {}

    def add(self, expert: int, token_idx, h) -> None:
        self.held[expert] = (token_idx, h)
        order, held = self.order, self.held
        while self.next < len(order) and order[self.next] in held:
            idx, h = held.pop(order[self.next])
            self.out.index_add_(0, idx, h.to(self.out.dtype))
            self.next += 1


def eager_loop(rt, ml, hidden_states, top_k_index, top_k_weights):
    """The eager loop of ``ml``'s family over arena views, in groups that fit (CPU)."""
    module = ml.module
    num_experts = module.num_experts
    out = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=num_experts + 1)
        expert_mask = expert_mask.permute(2, 1, 0)
        hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    experts = [e for e in hit[:, 0].tolist() if e < num_experts]
    rt.ahead.score(ml.layer, experts)
    predicted = rt.ahead.predict(ml, hidden_states) if rt.predict else None
    device = hidden_states.device
    acc = InOrder(out, experts)
    for group in rt._groups(ml, experts, predicted, as_ready=True):
        for e, views in group:
            w = ml.family.weights(module, views, device, ml.dtype)
            top_k_pos, token_idx = torch.where(expert_mask[e])
            acc.add(e, token_idx, ml.family.output(module, w, hidden_states[token_idx], token_idx,
                                                   top_k_pos, top_k_weights))
    return out


def sorted_loop(rt, ml, hidden_states, top_k_index, top_k_weights):
    """``eager_loop``'s order and bits from one stable sort per layer (a CUDA device)."""
    module, device = ml.module, hidden_states.device
    tokens = top_k_index.shape[0]
    out = torch.zeros_like(hidden_states)
    with torch.no_grad():
        # position k*tokens + t: eager's torch.where over expert_mask[e] ([k, tokens]) yields
        # an expert's pairs in this order, which a stable sort keeps
        flat = top_k_index.t().reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=module.num_experts + 1).tolist()
    starts, at = {}, 0
    for e, c in enumerate(counts):
        starts[e] = at
        at += c
    experts = [e for e in range(module.num_experts) if counts[e]]
    rt.ahead.score(ml.layer, experts)
    predicted = rt.ahead.predict(ml, hidden_states) if rt.predict else None
    for group in rt.gpu.groups(rt.client, rt._groups(ml, experts, predicted), device):
        for e, views in group:
            w = ml.family.weights(module, views, device, ml.dtype)
            pos = order[starts[e]:starts[e] + counts[e]]
            token_idx, top_k_pos = pos % tokens, pos // tokens
            ml.family.compute(module, w, hidden_states[token_idx], token_idx, top_k_pos, top_k_weights, out)
    return out


def fused(rt, ml, hidden_states, top_k_index, top_k_weights):
    """vLLM's numerics over arena views (module docstring)."""
    tokens, k = top_k_index.shape
    device = hidden_states.device
    scales = ws = rows = None
    mine = ml.mine                                 # an expert-parallel rank: only its experts' pairs
    if tokens * k <= SMALL_STEP:
        ids = top_k_index.reshape(-1).tolist()
        pairs = range(len(ids)) if mine is None else [i for i, e in enumerate(ids) if e in mine]
        order = sorted(pairs, key=ids.__getitem__)        # stable: token order per expert
        counts = Counter(ids) if mine is None else Counter(ids[i] for i in order)
        experts = sorted(counts)
        w = top_k_weights.reshape(-1).tolist()
        scales = [w[i] for i in order]            # a one-row run is scaled by a Python float
    else:                                                            # a prefill: torch sorts
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        if mine is not None:
            order = order[ml.mine_mask(device)[flat[order]]]
        counts = torch.bincount(flat[order], minlength=ml.module.num_experts).tolist()
        experts = [e for e, c in enumerate(counts) if c]
        rows = order // k
        ws = top_k_weights.reshape(-1)[order].unsqueeze(-1)
    st = rt.stats
    st.layer_steps += 1
    st.union += len(experts)
    st.routed += tokens * k
    rt.ahead.score(ml.layer, experts)
    predicted = rt.ahead.predict(ml, hidden_states) if rt.predict else None
    dtype, out_dtype = ml.dtype, hidden_states.dtype
    if isinstance(ml.family, GptOss):
        expert = gpt_oss_mxfp4.expert if ml.family.quantized else gpt_oss_expert
    else:
        expert = gated_expert
    parts, out = {}, None
    # each expert's run of rows, fixed by the ascending order whatever order they arrive in
    starts = dict(zip(experts, itertools.accumulate((counts[e] for e in experts), initial=0)))
    as_ready = device.type != "cuda"
    reduced = device.type == "cpu" and dtype in dispatch.REDUCED       # a bf16/fp16 engine on a CPU
    kern = dispatch.kernels(cpu.facts(), device.type, dtype, rt.native is not None, ml.rowmajor)
    native = rt.native if kern.rowmm_rows else None
    if (native is not None and rt.native_layer is not None and scales is not None and experts
            and expert is gated_expert and max(counts.values()) <= kern.rowmm_rows):
        out = _one_call(rt, ml, experts, predicted, counts, starts, hidden_states.float(), scales,
                        [i // k for i in order], dtype if reduced else None)
        return out if out.dtype == out_dtype else out.to(out_dtype)
    if scales is not None and tokens > 1:
        rows = torch.tensor([i // k for i in order], device=device)
        ws = torch.tensor(scales, dtype=top_k_weights.dtype, device=device).unsqueeze(-1)
    xs = hidden_states[rows] if tokens > 1 else hidden_states
    onednn = kern.onednn_rows
    # with the native kernel the weighted outputs are summed in float32 (vLLM's kernel does), else in out_dtype
    acc = torch.float32 if native is not None else out_dtype
    xf = xs.float() if native is not None else None        # its input: converted once per step
    mkldnn = on_ = torch.backends.mkldnn.enabled
    try:
        for group in rt.gpu.groups(rt.client, rt._groups(ml, experts, predicted, as_ready), device):
            for e, views in group:
                n, at = counts[e], starts[e]
                if n <= kern.rowmm_rows:
                    h = native(ml.module, views, xf if tokens == 1 else xf[at:at + n], dtype if reduced else None)
                    st.native_experts += 1
                else:
                    if onednn is not None and on_ != (mkldnn and n > onednn):
                        on_ = torch.backends.mkldnn.enabled = not on_
                    h = expert(ml.module, views, xs if tokens == 1 else xs[at:at + n], device, dtype)
                # in place, the product rounded to h's dtype: the bits of (h * w).to(dtype)
                h.mul_(scales[at] if n == 1 and scales is not None else ws[at:at + n])
                if h.dtype != acc:
                    h = h.to(acc)
                parts[e] = h                         # summed below, in ascending expert order
    finally:
        torch.backends.mkldnn.enabled = mkldnn
    ordered = [parts[e] for e in experts]
    if tokens > 1 and ordered:
        out = torch.zeros_like(hidden_states, dtype=acc)
        out.index_add_(0, rows, torch.cat(ordered) if len(ordered) > 1 else ordered[0])
    elif ordered:
        out = ordered[0]
        for h in ordered[1:]:
            out.add_(h)                              # one token: its experts in ascending order
    else:                                            # no token
        out = torch.zeros_like(hidden_states)
    if out.dtype != out_dtype:
        out = out.to(out_dtype)
    return out


def _one_call(rt, ml, experts, predicted, counts, starts, x, scales, tokens, reduced):
    """``fused``'s decode step with one native call per group (``Runtime.native_layer``; one group
    when the arena holds the layer's union), bit for bit the per-expert path's result: the call
    scales and sums each group's experts into ``out`` in ascending order, as ``fused`` sums them.
    A group comes whole (``client.fetch``, not ``as_ready``): with every expert resident it is
    answered at once; a miss makes the call wait for the group's reads (module docstring)."""
    out = None
    for group in rt._groups(ml, experts, predicted):
        out = rt.native_layer(ml.module, [v for _, v in group], [counts[e] for e, _ in group],
                              starts[group[0][0]], x, scales, tokens, reduced, out)
        rt.stats.native_experts += len(group)
        rt.stats.native_calls += 1
    return out


def gated_expert(math, views, x, device, dtype):
    """``act(x W_gate^T) * (x W_up^T) W_down^T``: gate and up in one ``linear`` when one view holds both
    (``views``: ``(gate_up, down)`` or ``(gate, up, down)``)."""
    if len(views) == 2:
        gate, up = F.linear(x, on(views[0], device, dtype)).chunk(2, dim=-1)
    else:
        gate = F.linear(x, on(views[0], device, dtype))
        up = F.linear(x, on(views[1], device, dtype))
    return F.linear(math.act_fn(gate) * up, on(views[-1], device, dtype))


def gpt_oss_expert(math, views, x, device, dtype):
    """gpt-oss's expert as vLLM computes it (``SwigluOAIAndMul.forward_native``): the checkpoint's
    ``gate_up_proj [H, 2I]`` holds gate and up *interleaved* (even and odd columns, which vLLM keeps
    when it transposes it into w13), gate clamped above and up on both sides at ``limit``,
    ``(up + 1) * gate * sigmoid(alpha * gate)``, then ``down_proj [I, H]``; both with their biases."""
    w = {n: on(v, device, dtype) for n, v in views.items()}
    gate_up = torch.addmm(w["gate_up_proj_bias"], x, w["gate_up_proj"])
    gate = gate_up[..., ::2].clamp(max=math.limit)
    up = gate_up[..., 1::2].clamp(min=-math.limit, max=math.limit)
    h = (up + 1) * (gate * torch.sigmoid(gate * math.alpha))
    bias = w.get("down_proj_bias")       # a tensor-parallel rank other than 0 has none (vLLM loads zeros)
    return torch.mm(h, w["down_proj"]) if bias is None else torch.addmm(bias, h, w["down_proj"])
