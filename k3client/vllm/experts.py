"""vLLM's routed experts computed from k3d arena views: the layers, their method, the refusal.

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
- ``apply`` hands the layer to the engine-neutral ``k3client.runtime.Runtime``
  (``runtime``, with vLLM's fused-MoE numerics: ``k3client.runtime.compute.fused``):
  the union of the step's experts, ascending, fetched in groups the arena allows
  (``k3client.runtime.epochs``' epochs and pins), each expert computed on the rows of
  its tokens, times their routing weights, summed per token in ascending expert
  order.  Gated families: ``act(x W_gate^T) * (x W_up^T) W_down^T`` (``native.rowmm``
  for small runs of bf16 row-major views, where ``k3client.runtime.dispatch`` picks it
  for the CPU: not for a bf16 engine on an AMX CPU, which uses oneDNN's AMX matmul; a
  decode step's layer in one ``native.layer_experts`` call, the same bits);
  gpt-oss: vLLM's ``swigluoai`` with both biases (``compute.gpt_oss_expert``; MXFP4 as
  shipped: ``k3client.runtime.gpt_oss_mxfp4``, dequantized per expert, where vLLM's CPU
  build computes MXFP4 at all: an x86 CPU with AMX).  What vLLM gives the runtime is ``layer``'s
  ``Layer``: an ``Activation`` for the math, the gate (logits, top-k) for gate-ahead.

The pin rule is the runtime's: one vLLM step (one model forward, B sequences)
is one epoch, a layer's pins end with its compute (``Runtime._layer_done``: its outputs
are computed, no view of it is read again), and a group that does not fit beside the
epoch's pins starts a new one.
The epoch of step t+1 begins (``begin_token(wait=False)``) right after step t's last
MoE layer, once no view of step t is read again; its reply is read before step t+1's
first fetch (``Client.settle``), so no view is answered before the daemon began the
epoch.  The forward pre-hook the loader installs begins one only where the step
before did not (the first step, or one that stopped before its last MoE layer).

What is refused, in one line naming the model type (``FamilyError``), when the
model is built: activations other than gated SiLU/GELU (gpt-oss: other than
``swigluoai``), expert biases outside gpt-oss, router weights applied on the input,
quantized experts other than gpt-oss's MXFP4, gpt-oss's MXFP4 where plain vLLM cannot
run it (a CPU without AMX: vLLM's CPU build has no other MXFP4 MoE kernel; a GPU engine or
tensor-parallel ranks: untested); and, with a ``ValueError`` naming vLLM, expert parallelism
on a CPU engine (vLLM 0.32's CPU worker crashes with it: ``ranks.ep_refusal``).

On a multi-rank engine each ``Layer`` carries its rank's part (``parallel``, from vLLM's
own MoE parallel config and expert map): ``shard``, the rank's tensor-parallel
``ranks.Shard``, by which ``k3client.runtime.views`` slices the whole-expert views
(gate/up rows, down columns: strided views, cached per slot), and ``mine``, the
expert-parallel rank's experts (the compute skips the pairs routed elsewhere).  The
output is the rank's partial sum, which vLLM's MoE runner all-reduces once, as for its
own experts (the method has no modular kernel that reduces).  Another
subclass of ``RoutedExperts`` is not replaced out of tree; the loader finds its
layers unbound and refuses it the same way.

Caller's obligations: the runtime is bound (``layer._k3d``) by ``loader.K3dLoader``
before the first forward; forwards run on the thread that loaded the model.
"""

from __future__ import annotations

import functools
import re

from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.models.gpt_oss import GptOssRoutedExperts

from k3client.runtime import ACTIVATIONS, Activation, GptOss, Layer, Runtime, StepStats
from k3client.runtime.families import FamilyError

from .. import cpu
from . import native, ranks, settings

LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
SUPPORTED = ("it computes gated SiLU/GELU experts without bias built by vLLM's RoutedExperts, and gpt-oss's "
             "experts (bf16, or MXFP4 as shipped where vLLM's CPU build computes them: x86 with AMX, one rank), "
             "on one rank or tensor-parallel ranks (tested: Qwen3-MoE, Mixtral, DeepSeek-V3, gpt-oss bf16)")


def _model_type() -> str:
    from vllm.config import get_current_vllm_config

    mc = get_current_vllm_config().model_config
    return getattr(getattr(mc, "hf_config", None), "model_type", "?") if mc is not None else "?"


def _device_type() -> str:
    from vllm.config import get_current_vllm_config

    dc = getattr(get_current_vllm_config(), "device_config", None)
    return str(getattr(dc, "device_type", None) or "cpu")


def _refuse(layer, moe_config, quant_config) -> None:
    """FamilyError unless the layer's experts are math this plugin computes: the gated MLP of
    ``RoutedExperts`` or, for ``GptOssRoutedExperts``, gpt-oss's biased clamped SwiGLU."""
    mt = _model_type()
    act = layer.activation.value
    gpt_oss = isinstance(layer, GptOssRoutedExperts)
    why = _quantized(layer, quant_config, moe_config) if quant_config is not None else None
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
    if why is None:
        # before any weight is read (the model is being built); the loader refuses it earlier still
        ep = ranks.ep_refusal(_device_type(), moe_config.moe_parallel_config.use_ep)
        if ep is not None:
            raise ValueError(ep)
    if why is not None:
        raise FamilyError(f"k3client.vllm cannot compute the experts of model type {mt!r} ({why}); {SUPPORTED}")


def _quantized(layer, quant_config, moe_config) -> str | None:
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
    if moe_config.moe_parallel_config.tp_size > 1:
        # ranks.Shard slices bf16 rows and columns; MXFP4's blocks of 32 along the down input are not sliced
        return f"MXFP4 experts ({name}) on tensor-parallel ranks: computed on one rank only"
    facts = cpu.facts()
    if not facts.amx:
        # vLLM's CPU build runs MXFP4 MoE only with CPUExpertsMxfp4, which needs AMX tiles; elsewhere plain
        # vLLM raises "No MXFP4 MoE backend supports the deployment configuration"
        return (f"MXFP4 experts ({name}): plain vLLM {__version__} computes them on a CPU only with AMX tiles "
                f"(CPUExpertsMxfp4) and this CPU has {facts.describe()}; serve a bf16 copy, or use "
                "k3client.hf, which dequantizes MXFP4")
    return None


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


# the vLLM classes replaced out of tree, by the name vLLM's registry keys them
REPLACED = ("RoutedExperts", "GptOssRoutedExperts")


def install() -> None:
    from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot

    for cls, name in zip((K3dRoutedExperts, K3dGptOssRoutedExperts), REPLACED):
        if op_registry_oot.get(name) is not cls:
            PluggableLayer.register_oot(cls, name=name)


# -- the runtime's side: what vLLM gives it ------------------------------------------------
def layer(index: int, mod, router, family, specs) -> Layer:
    """The runtime's ``Layer`` for one k3d experts layer: its math reads an ``Activation`` (vLLM's
    experts module holds no ``act_fn``), its router returns logits whose ``top_k`` are the experts,
    ``rowmajor`` says ``native.rowmm`` can read its views (gated families only; on a TP rank its
    shard's), and ``shard``/``mine`` are this rank's part (``parallel``)."""
    math = Activation(mod.global_num_experts, mod.activation.value, mod.moe_config)
    shard, mine = parallel(mod)
    tp = shard.size if shard is not None else 1
    rowmajor = not isinstance(family, GptOss) and native.eligible(specs, family, tp)
    return Layer(index, math, router, family, tuple(s.name for s in specs), mod.k3d_params_dtype,
                 top_k=mod.top_k, specs=specs, rowmajor=rowmajor, shard=shard, mine=mine)


def parallel(mod):
    """``(shard, mine)`` of a k3d experts module on this rank, from vLLM's own MoE parallel config
    and expert map (what vLLM's weight loader would have loaded here); ``(None, None)`` on one rank."""
    pc = mod.moe_config.moe_parallel_config
    shard = ranks.Shard(pc.tp_rank, pc.tp_size) if pc.tp_size > 1 else None
    emap = mod.expert_map if pc.use_ep else None
    mine = ranks.owned(emap.tolist()) if emap is not None else None
    return shard, mine


def runtime(client, layers: dict[int, Layer], predict: bool = True, native_kernel: bool = True) -> Runtime:
    """The runtime of one vLLM engine: vLLM's fused-MoE numerics (``k3client.runtime.compute.fused``),
    ``native.rowmm`` for small runs where it builds (compiled or found cached here, at load, not in
    the first step; the loader passes False for a model on a CUDA device), and no prediction for a
    layer whose experts the shared index shows all resident."""
    op = native.load() if native_kernel else None
    one = native.load_layer() if op is not None else None
    return Runtime(client, layers, predict=predict, numerics="fused",
                   native=functools.partial(native.gated_expert, op) if op is not None else None,
                   native_layer=functools.partial(native.layer_experts, one) if one is not None else None,
                   skip_resident=True)


__all__ = ["ACTIVATIONS", "K3dGptOssRoutedExperts", "K3dMoEMethod", "K3dRoutedExperts", "StepStats", "install",
           "is_k3d", "layer", "parallel", "runtime"]
