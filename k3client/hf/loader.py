"""``load_model``: a transformers model whose routed experts live in the k3d daemon.

How loading works (transformers 5, safetensors checkpoints):

1. connect first, so a daemon that is down fails in one line before any weight
   is read (``DaemonNotRunning`` naming the endpoint);
2. ``from_pretrained`` runs on a subclass whose ``_load_pretrained_model`` finds
   the experts modules (``@use_experts_implementation`` classes), maps every
   checkpoint key through the model's own renamings/converters
   (``rename_source_key``, the function transformers itself uses) and drops the
   keys that land in an experts module.  Only the headers are parsed and the
   other tensors are read by byte range without readahead (``checkpoint``), so
   no byte of an expert tensor is loaded (step 3's verify reads its samples,
   at most 32 KiB a tensor, and drops their pages again);
3. before anything else is loaded, the daemon's layers, experts and layouts are
   compared with the checkpoint's headers (``fingerprint.check``): another
   checkpoint is refused in one line.  Before that, right after connecting and
   before any model is built, ``Client.verify`` compares the daemon's content
   digest with the checkpoint's sampled bytes, so a fine-tune with the served
   model's shapes is refused too (a hub id: once its files are local, in step 2);
4. ``_finalize_model_loading`` takes the expert parameters out of the missing keys
   (so nothing allocates or initialises them), then they are turned into plain
   meta tensors, no longer parameters: ``model.to(device)`` and ``state_dict``
   skip them, and no byte of them exists in the process;
5. every experts module gets its layer's ``k3client.runtime.Layer`` (family math,
   router for gate-ahead; ``runtime``) and the model's config uses the ``"k3d"`` experts implementation;
   a forward pre-hook on the decoder begins each forward's epoch.

Caller's obligations: use the model from the thread that loaded it (one client
socket); ``model.k3d`` is the ``k3client.runtime.Runtime`` (client, stats); ``model.k3d.client.close()``
or process exit releases the pins.
"""

from __future__ import annotations

import os
import re

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.core_model_loading import (
    WeightConverter,
    WeightRenaming,
    rename_source_key,
)

from ..client import connect
from ..runtime import Layer
from . import families, fingerprint, gpu, runtime as adapter
from .checkpoint import Files, LazyTensor

IMPLEMENTATION = "k3d"
LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def experts_modules(model) -> dict[str, torch.nn.Module]:
    """Modules whose forward dispatches through ExpertsInterface, by qualified name."""
    return {name: m for name, m in model.named_modules() if hasattr(m, "is_transposed") and hasattr(m, "has_gate")}


def _layer_of(name: str) -> int:
    m = LAYER.search(name)
    if m is None:
        raise families.FamilyError(f"experts module {name} is not under a numbered layer; k3client.hf cannot serve it")
    return int(m.group(1))


def _router_of(model, name: str):
    """The sibling router of an experts module (``gate`` or ``router``), for gate-ahead."""
    parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
    for attr in ("gate", "router"):
        r = getattr(parent, attr, None)
        if isinstance(r, torch.nn.Module) and getattr(r, "weight", None) is not None:
            return r
    return None


class _Plan:
    """What the subclass's load hooks found: expert params, the layers, the client."""

    def __init__(self, client, path):
        self.client, self.path = client, path
        self.expert_params: set[str] = set()
        self.layers: dict[int, Layer] = {}
        self.verified = False         # Client.verify passed (a local path: before anything is built)


def _split_state_dict(model, checkpoint_files, load_config, plan: _Plan, files: Files):
    """(lazy non-expert tensors, {layer: [(key, dtype, shape)]} of the expert keys, never opened)."""
    mods = experts_modules(model)
    plan.expert_params = {f"{n}.{p}" for n, m in mods.items() for p, _ in m.named_parameters(recurse=False)}
    mapping = load_config.weight_mapping or []
    renamings = [w for w in mapping if isinstance(w, WeightRenaming)]
    converters = [w for w in mapping if isinstance(w, WeightConverter)]
    meta_sd = model.state_dict()
    kept, expert_keys = {}, {}
    for path in checkpoint_files:
        if not path.endswith(".safetensors"):
            raise ValueError(f"k3client.hf loads safetensors checkpoints; {path} is not one")
        header, start = files.header(path)
        for key, info in header.items():
            renamed, _ = rename_source_key(key, renamings, converters, model.base_model_prefix, meta_sd)
            if renamed in plan.expert_params:
                expert_keys.setdefault(_layer_of(renamed), []).append((key, info["dtype"], tuple(info["shape"])))
            else:
                kept[key] = LazyTensor(files, path, start, info)     # read by transformers as usual
    return kept, expert_keys


def _bind_layers(model, plan: _Plan, model_type: str) -> None:
    client = plan.client
    for name, mod in experts_modules(model).items():
        layer = _layer_of(name)
        layout = client.layout_of(layer)
        fam = families.family_for(mod, model_type, {s.name for s in layout})
        dtype = next(p.dtype for _, p in mod.named_parameters(recurse=False))
        plan.layers[layer] = adapter.layer(layer, mod, _router_of(model, name), fam, layout, dtype)


def _make_loader_class(cls, plan: _Plan):
    def _load_pretrained_model(model, state_dict, checkpoint_files, load_config, expected_keys=None):
        if state_dict is not None or not checkpoint_files:
            raise ValueError("k3client.hf.load_model loads from a checkpoint directory, not a state_dict")
        model_type = getattr(model.config, "model_type", type(model).__name__)
        if not experts_modules(model):
            raise families.FamilyError(
                f"model type {model_type!r} ({type(model).__name__}) has no experts module that dispatches "
                f"through transformers' ExpertsInterface; k3client.hf computes: {families.supported()}")
        if not plan.verified:
            plan.client.verify(os.path.dirname(checkpoint_files[0]))
        files = Files()
        try:
            kept, expert_keys = _split_state_dict(model, checkpoint_files, load_config, plan, files)
            num_experts = next(iter(experts_modules(model).values())).num_experts
            fingerprint.check(plan.client, plan.path, fingerprint.local_layers(expert_keys), num_experts)
            _bind_layers(model, plan, model_type)
            return cls._load_pretrained_model(model, kept, None, load_config, expected_keys)
        finally:
            files.close()

    def _finalize_model_loading(model, load_config, loading_info):
        loading_info.missing_keys -= plan.expert_params
        for name in plan.expert_params:
            model.get_parameter(name)._is_hf_initialized = True
        return cls._finalize_model_loading(model, load_config, loading_info)

    return type(cls.__name__, (cls,), {
        "__module__": cls.__module__, "__qualname__": cls.__qualname__,
        "_load_pretrained_model": staticmethod(_load_pretrained_model),
        "_finalize_model_loading": staticmethod(_finalize_model_loading),
    })


def _strip_expert_params(model, plan: _Plan) -> None:
    """Expert parameters become plain meta attributes: no storage, skipped by .to() and state_dict."""
    for name in plan.expert_params:
        owner_name, attr = name.rsplit(".", 1)
        owner = model.get_submodule(owner_name)
        p = owner._parameters.pop(attr)
        object.__setattr__(owner, attr, torch.empty(p.shape, dtype=p.dtype, device="meta"))


def _decoder(model, plan: _Plan):
    """The module that runs the layers (every forward passes it): the epoch hook goes there."""
    any_layer = next(iter(plan.layers.values()))
    for name, mod in model.named_modules():
        if mod is any_layer.module:
            prefix = name.split(".layers.")[0] if ".layers." in name else ""
            return model.get_submodule(prefix) if prefix else model
    return model


def _dequantized_by_default(config, kwargs: dict) -> None:
    """An MXFP4 checkpoint (gpt-oss as shipped) builds the bf16 experts module: k3d dequantizes per expert.

    transformers would otherwise ask for accelerate/kernels for a quantized module no
    byte of which is ever loaded here."""
    q = getattr(config, "quantization_config", None)
    method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    if str(getattr(method, "value", method)) == "mxfp4" and "quantization_config" not in kwargs:
        from transformers import Mxfp4Config
        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)


def load_model(path: str, endpoint: str | None = None, name: str | None = None, predict: bool = True,
               **from_pretrained_kwargs):
    """The causal LM at ``path``, its routed experts served by the k3d daemon at ``endpoint``."""
    if from_pretrained_kwargs.pop("experts_implementation", IMPLEMENTATION) != IMPLEMENTATION:
        raise ValueError("load_model uses experts_implementation='k3d'; use from_pretrained for others")
    client = connect(endpoint, name=name or f"hf-{os.getpid()}")
    try:
        if os.path.exists(path):          # a hub id is verified once its files are local (_load_pretrained_model)
            client.verify(path)
        config = from_pretrained_kwargs.pop("config", None) or AutoConfig.from_pretrained(path)
        base = from_pretrained_kwargs.pop("model_class", None) or AutoModelForCausalLM._model_mapping[type(config)]
        _dequantized_by_default(config, from_pretrained_kwargs)
        plan = _Plan(client, os.path.abspath(path))
        plan.verified = os.path.exists(path)
        cls = _make_loader_class(base, plan)
        model = cls.from_pretrained(path, config=config, experts_implementation=IMPLEMENTATION,
                                    **from_pretrained_kwargs)
        model.__class__ = base
        _strip_expert_params(model, plan)
        rt = adapter.runtime(client, plan.layers, predict=predict)
        rt.gpu.use(client, gpu.cuda_devices(model))     # a model loaded onto CUDA: registered now
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.disable_compile = True   # k3client/gpu/guards.py
        for ml in plan.layers.values():
            ml.module._k3d = (rt, ml)
        _decoder(model, plan).register_forward_pre_hook(lambda mod, args: rt.begin_forward())
        model.k3d = rt
        return model
    except BaseException:
        client.close()
        raise


@torch.compiler.disable
def k3d_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The ``"k3d"`` experts implementation: ``fn(self, hidden_states, top_k_index, top_k_weights)``;
    never traced by Dynamo (fetches, IPC: ``k3client/gpu/guards.py``)."""
    bound = getattr(self, "_k3d", None)
    if bound is None:
        raise RuntimeError(f"{type(self).__name__} uses experts_implementation='k3d' but was not loaded by "
                           "k3client.hf.load_model (its experts live in the daemon)")
    rt, ml = bound
    return rt.run_layer(ml, hidden_states, top_k_index, top_k_weights)

