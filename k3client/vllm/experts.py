"""vLLM's routed experts computed from k3d arena views: the layers, their method, the runtime.

``K3dRoutedExperts`` replaces vLLM's ``RoutedExperts`` and ``K3dGptOssRoutedExperts``
gpt-oss's ``GptOssRoutedExperts`` through ``PluggableLayer.register_oot`` (vLLM's
out-of-tree layer hook, keyed by the class name the model instantiates).  When the
model's ``additional_config`` has no ``k3d`` key each is vLLM's class, byte for byte
the same path.  With the key its quant method is ``K3dMoEMethod``:

- ``create_weights`` registers no parameter: no ``w13_weight``/``w2_weight`` (nor
  gpt-oss's ``w13_bias``/``w2_bias``) storage exists in the process, and vLLM's
  weight tracking does not expect any;
- it is a *modular* method, so vLLM's runner first runs vLLM's own router
  (``select_experts``: softmax or sigmoid scoring, grouped top-k, correction bias,
  renormalisation, routed scaling, as the family configures it) and then calls
  ``apply(x, topk_weights, topk_ids)``; shared experts stay vLLM's (the runner
  runs them, since this method has no kernel to overlap them with);
- ``apply`` hands the layer to ``VllmRuntime.run_layer``: the union of the step's
  experts, ascending, fetched in groups the arena allows (``k3client.hf.runtime``'s
  epochs and pins), each expert computed on the rows of its tokens, times their
  routing weights, summed per token in ascending expert order.  Gated families:
  ``act(x W_gate^T) * (x W_up^T) W_down^T``; gpt-oss: vLLM's ``swigluoai`` with both
  biases (``_gpt_oss_expert``; MXFP4 as shipped: ``gpt_oss_mxfp4.expert``, dequantized
  per expert from the daemon's blocks and scales, where vLLM's CPU build computes MXFP4
  at all: an x86 CPU with AMX).  Which kernel computes a run of rows (native.rowmm,
  torch with or without oneDNN) is ``dispatch.kernels``' choice for the CPU
  (``k3client.cpu``), the dtype and the layer.

The pin rule is ``k3client.hf``'s: one vLLM step (one model forward, B sequences)
is one epoch, and a group that does not fit beside the epoch's pins starts a new one.
The epoch of step t+1 begins (``begin_token(wait=False)``) right after step t's last
MoE layer, once no view of step t is read again; its reply is read before step t+1's
first fetch (``Client.settle``), so no view is answered before the daemon began the
epoch.  The forward pre-hook the loader installs begins one only where the step
before did not (the first step, or one that stopped before its last MoE layer).

What is refused, in one line naming the model type (``FamilyError``), when the
model is built: activations other than gated SiLU/GELU (gpt-oss: other than
``swigluoai``), expert biases outside gpt-oss, router weights applied on the input,
quantized experts other than gpt-oss's MXFP4, gpt-oss's MXFP4 where plain vLLM cannot
run it (a CPU without AMX: vLLM's CPU build has no other MXFP4 MoE kernel; a GPU engine:
untested), and tensor/expert parallelism (each rank would compute whole experts).  Another
subclass of ``RoutedExperts`` is not replaced out of tree; the loader finds its
layers unbound and refuses it the same way.

Caller's obligations: the runtime is bound (``layer._k3d``) by ``loader.K3dLoader``
before the first forward; forwards run on the thread that loaded the model.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.models.gpt_oss import GptOssRoutedExperts

from k3client.hf.families import FamilyError, GptOss, _on
from k3client.hf.runtime import MoeLayer, Runtime, Stats

from .. import cpu
from . import dispatch, gpt_oss_mxfp4, native, settings

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}
LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
SUPPORTED = ("it computes gated SiLU/GELU experts without bias built by vLLM's RoutedExperts, and gpt-oss's "
             "experts (bf16, or MXFP4 as shipped where vLLM's CPU build computes them: x86 with AMX), on one rank "
             "(tested: Qwen3-MoE, Mixtral, DeepSeek-V3, gpt-oss bf16)")
# a decode step's (token, expert) pairs up to which run_layer sorts them in Python
SMALL_STEP = 64
# vLLM's SwigluOAIAndMul defaults: gpt-oss's MoE config leaves swiglu_alpha/limit unset and its
# CPU kernel uses these
OAI_ALPHA, OAI_LIMIT = 1.702, 7.0


def _model_type() -> str:
    from vllm.config import get_current_vllm_config

    mc = get_current_vllm_config().model_config
    return getattr(getattr(mc, "hf_config", None), "model_type", "?") if mc is not None else "?"


def _refuse(layer, moe_config, quant_config) -> None:
    """FamilyError unless the layer's experts are math this plugin computes: the gated MLP of
    ``RoutedExperts`` or, for ``GptOssRoutedExperts``, gpt-oss's biased clamped SwiGLU."""
    mt = _model_type()
    act = layer.activation.value
    gpt_oss = isinstance(layer, GptOssRoutedExperts)
    why = _quantized(layer, quant_config) if quant_config is not None else None
    if why is not None:
        pass
    elif gpt_oss and act != "swigluoai":
        why = f"gpt-oss experts with activation {act!r}, not 'swigluoai'"
    elif not gpt_oss and act not in ACTIVATIONS:
        why = f"expert activation {act!r}"
    elif not gpt_oss and moe_config.has_bias:
        why = "expert biases"
    elif layer.apply_router_weight_on_input:
        why = "router weights applied to the input"
    elif moe_config.moe_parallel_config.tp_size > 1 or moe_config.moe_parallel_config.use_ep:
        why = "tensor or expert parallelism"
    if why is not None:
        raise FamilyError(f"k3client.vllm cannot compute the experts of model type {mt!r} ({why}); {SUPPORTED}")


def _quantized(layer, quant_config) -> str | None:
    """None where the plugin computes these quantized experts (gpt-oss's MXFP4 on a CPU engine where
    plain vLLM does: AMX); else why not."""
    name = type(quant_config).__name__
    if "mxfp4" not in name.lower():
        return f"quantized experts ({name})"
    if not isinstance(layer, GptOssRoutedExperts):
        return f"MXFP4 experts ({name}) outside gpt-oss"
    from vllm import __version__
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return (f"MXFP4 experts ({name}) on {current_platform.device_name}: computed on CPU engines only, where "
                "vLLM's CPUExpertsMxfp4 is the reference they are tested against")
    facts = cpu.facts()
    if not facts.amx:
        # vLLM's CPU build runs MXFP4 MoE only with CPUExpertsMxfp4, which needs AMX tiles; elsewhere plain
        # vLLM raises "No MXFP4 MoE backend supports the deployment configuration"
        return (f"MXFP4 experts ({name}): plain vLLM {__version__} computes them on a CPU only with AMX tiles "
                f"(CPUExpertsMxfp4) and this CPU has {facts.describe()}; serve a bf16 copy, or use "
                "k3client.hf, which dequantizes MXFP4")
    return None


class _Math:
    """What ``VllmRuntime.run_layer`` reads from an experts module: the expert count and the
    activation (gated SiLU/GELU: ``act_fn``; gpt-oss: ``alpha``/``limit`` of its clamped SwiGLU)."""

    def __init__(self, num_experts: int, activation: str, moe_config=None):
        self.num_experts = num_experts
        self.act_fn = ACTIVATIONS.get(activation)
        self.alpha = getattr(moe_config, "swiglu_alpha", None) or OAI_ALPHA
        self.limit = getattr(moe_config, "swiglu_limit", None) or OAI_LIMIT


class K3dMoEMethod(FusedMoEMethodBase):
    """No expert storage; ``apply`` computes the routed experts from the daemon's views."""

    def __init__(self, moe_config):
        super().__init__(moe_config)

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       **extra_weight_attrs):
        layer.k3d_params_dtype = params_dtype      # the dtype vLLM would hold the experts in

    def process_weights_after_loading(self, layer) -> None:
        pass

    def get_fused_moe_quant_config(self, layer):
        return None

    @property
    def is_monolithic(self) -> bool:
        return False                               # vLLM's router runs first, then apply()

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        bound = getattr(layer, "_k3d", None)
        if bound is None:
            raise RuntimeError(f"{layer.layer_name}: k3d experts were not bound by k3client.vllm's loader "
                               "(load_format must be auto or safetensors)")
        rt, ml = bound
        return rt.run_layer(ml, x, topk_ids.long(), topk_weights)


class _K3dExperts:
    """Mixin: with ``additional_config['k3d']`` the layer's method is ``K3dMoEMethod``, else vLLM's own."""

    def _get_quant_method(self, prefix, quant_config, moe_config):
        if settings.current() is None:
            return super()._get_quant_method(prefix, quant_config, moe_config)
        _refuse(self, moe_config, quant_config)
        self.k3d_mxfp4 = quant_config is not None      # accepted quantized experts are gpt-oss's MXFP4
        return K3dMoEMethod(moe_config)

    @property
    def k3d_layer(self) -> int:
        m = LAYER.search(self.layer_name)
        if m is None:
            raise FamilyError(f"MoE layer {self.layer_name} is not under a numbered layer; k3client.vllm "
                              "cannot name its experts to the daemon")
        return int(m.group(1))


class K3dRoutedExperts(_K3dExperts, RoutedExperts):
    """vLLM's ``RoutedExperts``; with ``additional_config['k3d']`` its method is ``K3dMoEMethod``."""


class K3dGptOssRoutedExperts(_K3dExperts, GptOssRoutedExperts):
    """gpt-oss's ``GptOssRoutedExperts`` (a subclass, so registered out of tree under its own name)."""


def is_k3d(module) -> bool:
    return isinstance(module, _K3dExperts) and isinstance(module.quant_method, K3dMoEMethod)


def install() -> None:
    from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot

    for cls, name in ((K3dRoutedExperts, "RoutedExperts"), (K3dGptOssRoutedExperts, "GptOssRoutedExperts")):
        if op_registry_oot.get(name) is not cls:
            PluggableLayer.register_oot(cls, name=name)


@dataclass
class VllmStats(Stats):
    """``Stats`` plus, per MoE layer and step, the experts fetched (the union) against tokens x top-k,
    and how many experts ``native.rowmm`` computed."""

    layer_steps: int = 0
    union: int = 0          # distinct experts a layer's tokens were routed to, summed over layer-steps
    routed: int = 0         # tokens x top-k, summed over layer-steps
    native_kernel: bool = False     # native.rowmm loaded (VllmRuntime's native_kernel, and it built)
    native_experts: int = 0         # experts computed by it

    def as_dict(self) -> dict:
        d = super().as_dict()
        n = self.layer_steps
        d["experts_per_layer_step"] = self.union / n if n else None
        d["routed_per_layer_step"] = self.routed / n if n else None
        return d


class VllmRuntime(Runtime):
    """``k3client.hf``'s epochs, groups and pins, with a layer compute of its own.

    ``run_layer`` sorts the step's (token, expert) pairs by expert once (stable), gathers
    the tokens' rows once, computes each fetched expert on its contiguous run of rows
    (gate and up in one ``linear`` when they lie back to back in the slot; the kernel per
    run, rowmm or torch with or without oneDNN, as ``dispatch.kernels`` decides for this
    CPU, dtype and layer), scales them by their
    routing weights in place and adds them per token in ascending expert order, as the
    per-expert loop did: one ``index_add_``, or for one token plain ``add_``s.  On a CPU the
    experts are computed as they arrive (``Client.fetch_iter``: resident ones first,
    overlapping the others' reads); their outputs are kept per expert and summed in
    ascending order once all are in, so the sum's bits do not depend on arrival.  A decode
    step (at most ``SMALL_STEP`` pairs) is sorted in Python on one ``tolist``: the torch
    calls a sort needs (argsort, bincount, gathers) cost more than the sort at that size.
    The next layer's gate picks the gate-ahead predictions, unless the shared index shows
    all of that layer's experts resident (``Client.layer_resident``: they would send
    nothing; ``stats.predicted`` then counts only the predictions made); ``stats`` adds
    the union against B x top-k.  With ``native_kernel`` (the default) on a CPU with AVX-512, an
    eligible layer's experts of at most ``dispatch.NATIVE_MAX_ROWS`` rows are computed by
    ``native.rowmm`` straight from the bf16 views (no cast in a float32 engine; a bf16 engine
    on an AMX CPU uses oneDNN instead), and the
    step's weighted expert outputs are summed in float32 and rounded once, where vLLM's
    fused kernel rounds them.  Invariants: ``torch.backends.mkldnn.enabled`` is as the caller
    left it when ``run_layer`` returns or raises; ``stats.epochs == stats.forwards``
    while no mid-forward epoch was needed."""

    def __init__(self, client, layers, predict=True, native_kernel=True):
        super().__init__(client, layers, predict=predict)
        self.stats = VllmStats()
        # compiled (or found cached) here, at load, not in the first forward (the loader passes
        # False for a model on a CUDA device)
        self._rowmm = native.load() if native_kernel else None
        self.stats.native_kernel = self._rowmm is not None
        self.cpu = cpu.facts()          # with the dtype and the views, picks each layer's kernels

    def run_layer(self, ml, hidden_states, top_k_index, top_k_weights):
        tokens, k = top_k_index.shape
        device = hidden_states.device
        scales = ws = None
        if tokens * k <= SMALL_STEP:
            ids = top_k_index.reshape(-1).tolist()
            order = sorted(range(len(ids)), key=ids.__getitem__)        # stable: token order per expert
            counts = Counter(ids)
            experts = sorted(counts)
            w = top_k_weights.reshape(-1).tolist()
            scales = [w[i] for i in order]            # a one-row run is scaled by a Python float
            if tokens > 1:
                rows = torch.tensor([i // k for i in order], device=device)
                ws = torch.tensor(scales, dtype=top_k_weights.dtype, device=device).unsqueeze(-1)
        else:                                                            # a prefill: torch sorts
            flat = top_k_index.reshape(-1)
            order = torch.argsort(flat, stable=True)
            counts = torch.bincount(flat, minlength=ml.module.num_experts).tolist()
            experts = [e for e, c in enumerate(counts) if c]
            rows = order // k
            ws = top_k_weights.reshape(-1)[order].unsqueeze(-1)
        st = self.stats
        st.layer_steps += 1
        st.union += len(experts)
        st.routed += tokens * k
        xs = hidden_states[rows] if tokens > 1 else hidden_states
        self._score_prediction(ml.layer, experts)
        predicted = self._predict_next(ml, hidden_states) if self.predict else None
        dtype, out_dtype = ml.dtype, hidden_states.dtype
        if isinstance(ml.family, GptOss):
            expert = gpt_oss_mxfp4.expert if ml.family.quantized else _gpt_oss_expert
        else:
            expert = _gated_expert
        parts, out = {}, None
        # each expert's run of rows, fixed by the ascending order whatever order they arrive in
        starts = dict(zip(experts, itertools.accumulate((counts[e] for e in experts), initial=0)))
        as_ready = device.type != "cuda"
        reduced = device.type == "cpu" and dtype in dispatch.REDUCED       # a bf16/fp16 engine on a CPU
        kern = dispatch.kernels(self.cpu, device.type, dtype, self._rowmm is not None, ml.rowmajor)
        rowmm = self._rowmm if kern.rowmm_rows else None
        onednn = kern.onednn_rows
        # with rowmm the weighted outputs are summed in float32 (vLLM's kernel does), else in out_dtype
        acc = torch.float32 if rowmm is not None else out_dtype
        xf = xs.float() if rowmm is not None else None        # rowmm's input: converted once per step
        mkldnn = on = torch.backends.mkldnn.enabled
        try:
            for group in self.gpu.groups(self.client, self._groups(ml, experts, predicted, as_ready), device):
                for e, views in group:
                    n, at = counts[e], starts[e]
                    if n <= kern.rowmm_rows:
                        h = native.gated_expert(rowmm, ml.module, views, xf if tokens == 1 else xf[at:at + n],
                                                dtype if reduced else None)
                        st.native_experts += 1
                    else:
                        if onednn is not None and on != (mkldnn and n > onednn):
                            on = torch.backends.mkldnn.enabled = not on
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
        if ml.next is None:
            self._begin_next()
        return out

    def _views(self, ml, ex):
        """gpt-oss: ``{name: view}``; gated families: ``(gate_up, down)`` or ``(gate, up, down)``."""
        f = ml.family
        if isinstance(f, GptOss):
            return {n: ex.tensor(n) for n in (gpt_oss_mxfp4.NAMES if f.quantized else f.NAMES)}
        if f.gate_up is not None:
            return ex.tensor(f.gate_up), ex.tensor(f.down)
        if ml.fused:
            v = ex.stacked((f.gate, f.up))
            if v is not None:
                return v, ex.tensor(f.down)
        return ex.tensor(f.gate), ex.tensor(f.up), ex.tensor(f.down)

    def _predict_next(self, ml, hidden_states):
        """The next MoE layer's own gate on this layer's input: its top-k experts travel with this fetch."""
        nxt = self.layers.get(ml.next) if ml.next is not None else None
        # every expert of the next layer resident: whatever its gate picks, the prediction would
        # send nothing (the client drops resident keys), so its matmul and top-k are skipped
        if nxt is None or nxt.router is None or self.client.layer_resident(nxt.layer, nxt.module.num_experts):
            self._pending_prediction = None
            return None
        with torch.no_grad():
            logits = nxt.router(hidden_states)
        if isinstance(logits, tuple):
            logits = logits[0]
        k = min(nxt.top_k, logits.shape[-1])
        experts = sorted(set(torch.topk(logits.float(), k, dim=-1).indices.reshape(-1).tolist()))
        self._pending_prediction = (nxt.layer, set(experts))
        return [(nxt.layer, e) for e in experts]


def _gated_expert(math, views, x, device, dtype):
    """``act(x W_gate^T) * (x W_up^T) W_down^T``: gate and up in one ``linear`` when one view holds both
    (``views``: ``(gate_up, down)`` or ``(gate, up, down)``)."""
    if len(views) == 2:
        gate, up = F.linear(x, _on(views[0], device, dtype)).chunk(2, dim=-1)
    else:
        gate = F.linear(x, _on(views[0], device, dtype))
        up = F.linear(x, _on(views[1], device, dtype))
    return F.linear(math.act_fn(gate) * up, _on(views[-1], device, dtype))


def _gpt_oss_expert(math, views, x, device, dtype):
    """gpt-oss's expert as vLLM computes it (``SwigluOAIAndMul.forward_native``): the checkpoint's
    ``gate_up_proj [H, 2I]`` holds gate and up *interleaved* (even and odd columns, which vLLM keeps
    when it transposes it into w13), gate clamped above and up on both sides at ``limit``,
    ``(up + 1) * gate * sigmoid(alpha * gate)``, then ``down_proj [I, H]``; both with their biases."""
    w = {n: _on(v, device, dtype) for n, v in views.items()}
    gate_up = torch.addmm(w["gate_up_proj_bias"], x, w["gate_up_proj"])
    gate = gate_up[..., ::2].clamp(max=math.limit)
    up = gate_up[..., 1::2].clamp(min=-math.limit, max=math.limit)
    h = (up + 1) * (gate * torch.sigmoid(gate * math.alpha))
    return torch.addmm(w["down_proj_bias"], h, w["down_proj"])


class VllmLayer(MoeLayer):
    """``MoeLayer`` plus the top-k its gate picks (for gate-ahead), ``fused``: the layout
    puts the gate and up tensors back to back, so one view covers both, and ``rowmajor``:
    ``native.rowmm`` can read its views (both for gated families only)."""

    def __init__(self, layer, math, router, family, names, dtype, top_k, specs=()):
        super().__init__(layer, math, router, family, names, dtype)
        self.top_k = top_k
        self.fused = self.rowmajor = False
        if isinstance(family, GptOss):
            return
        self.rowmajor = native.eligible(specs, family)
        by = {s.name: s for s in specs}
        g, u = by.get(family.gate), by.get(family.up)
        self.fused = (g is not None and u is not None and u.offset == g.offset + g.nbytes and g.dtype == u.dtype
                      and tuple(g.shape[1:]) == tuple(u.shape[1:]))
