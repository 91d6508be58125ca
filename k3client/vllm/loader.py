"""``K3dLoader``: vLLM's default safetensors loader that leaves the routed experts to k3d.

Registered (``register_model_loader``) for the ``auto``, ``safetensors`` and ``hf``
load formats, the ones vLLM's ``DefaultModelLoader`` serves.  Without
``additional_config['k3d']`` it *is* ``DefaultModelLoader`` (``load_model`` and
``get_all_weights`` go straight to it).  With it, ``load_model``:

1. refuses an engine configuration the runtime cannot serve (``guards.config_refusal``:
   compilation or CUDA graphs on, a runner that does not run one forward per step, data
   parallelism on a CPU), then connects to the daemon, so a daemon that is down fails in
   one line (``DaemonNotRunning`` naming the endpoint) before any weight is read;
2. parses only the safetensors headers (``k3client.hf.checkpoint``), sorts the
   routed-expert keys (``layers.{l}. ... .experts.``; shared experts are
   ``shared_expert(s)`` and stay) from the rest, and compares them with what the
   daemon serves (``k3client.hf.fingerprint.check``: another checkpoint is the
   one-line ``Mismatch``), then the sampled bytes of every expert tensor with the
   daemon's content digest (``Client.verify``: a fine-tune of the served model,
   same shapes and other values, is the one-line ``Mismatch`` too), all before
   vLLM builds the model;
3. lets vLLM build the model (``experts.K3dRoutedExperts`` allocates no expert
   storage), checks in ``create_model``, before a weight is read, that every MoE layer
   vLLM built is the plugin's (``guards.experts_refusal``: vLLM bypassed the out-of-tree
   registration) and that they cover the checkpoint's expert layers (else the family's
   ``FamilyError``), and loads every other tensor through the model's own ``load_weights``,
   each read by ``pread`` of its own byte range without readahead, so no page of
   an expert tensor is read by this process;
4. binds every k3d MoE layer to one ``k3client.runtime.Runtime`` (``experts.runtime``;
   each layer's daemon layout, family math and the next layer's gate for gate-ahead:
   ``experts.layer``) and installs a forward pre-hook on the model: each vLLM step
   is one epoch (``Runtime.begin_forward``:
   begun there unless the last step's last MoE layer began it already).

``model.k3d`` is the runtime (``client``, ``stats``).  Caller's obligations: the
process that loads the model runs its forwards on the same thread (one client
socket); process exit releases the pins.
"""

from __future__ import annotations

import logging
import os
import re

import torch
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from k3client.client import connect
from k3client.hf import fingerprint
from k3client.hf.checkpoint import Files, LazyTensor
from k3client.runtime import FamilyError, GptOss, Runtime, Standard
from k3client.runtime.gpu import cuda_devices

from . import experts, guards, ranks, settings
from .experts import REPLACED, SUPPORTED, K3dGptOssRoutedExperts, is_k3d

FORMATS = ("auto", "safetensors", "hf")
EXPERT_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:.*\.)?experts\.")


def _num_experts(hf_config) -> int:
    cfg = getattr(hf_config, "text_config", None) or hf_config
    for attr in ("num_experts", "num_local_experts", "n_routed_experts"):
        n = getattr(cfg, attr, None)
        if isinstance(n, int) and n > 0:
            return n
    raise FamilyError(f"model type {getattr(cfg, 'model_type', '?')!r}: no expert count in its config "
                      "(num_experts, num_local_experts or n_routed_experts); k3client.vllm cannot serve it")


def _router_of(model, experts_name: str):
    """The gate of the MoE block that owns ``experts_name`` (``...mlp.experts.routed_experts``)."""
    block = experts_name.split(".experts.")[0] if ".experts." in experts_name else experts_name.rsplit(".", 1)[0]
    try:
        owner = model.get_submodule(block)
    except AttributeError:
        return None
    for attr in ("gate", "router"):
        r = getattr(owner, attr, None)
        if isinstance(r, torch.nn.Module):
            return r
    return None


class K3dLoader(DefaultModelLoader):
    """See the module docstring."""

    _k3d_plan = None            # [(file, data start, key, header info)] of the non-expert tensors
    _k3d_dir = None             # the directory of the checkpoint's weight files
    _k3d_layers = None          # the layers with routed-expert tensors in the checkpoint

    def load_model(self, vllm_config, model_config, prefix: str = ""):
        st = settings.from_config(vllm_config)
        if st is None:
            return super().load_model(vllm_config, model_config, prefix)
        refusal = guards.config_refusal(vllm_config) or _ep_refusal(vllm_config)
        if refusal:
            raise ValueError(refusal)
        tp_rank, tp_size = _tp_rank()
        name = st.name or f"vllm-{os.getpid()}"
        client = connect(st.endpoint, name=f"{name}-tp{tp_rank}" if tp_size > 1 else name)
        files = Files()
        try:
            path = model_config.model
            expert_keys = self._plan(files, model_config)
            num_experts = _num_experts(model_config.hf_config)
            fingerprint.check(client, path, fingerprint.local_layers(expert_keys), num_experts)
            client.verify(path if os.path.isdir(path) else self._k3d_dir)
            model = super().load_model(vllm_config, model_config, prefix)
            rt = _bind(model, client, st, sorted(expert_keys), path, tp_rank)
            model.k3d = rt
            model.register_forward_pre_hook(lambda mod, args: rt.begin_forward())
            return model
        except BaseException:
            client.close()
            raise
        finally:
            self._k3d_plan = self._k3d_layers = None
            files.close()

    def _plan(self, files: Files, model_config) -> dict[int, list]:
        """Headers only: keep the non-expert tensors for ``get_all_weights``; return the expert keys per layer."""
        _, weight_files, use_safetensors, _ = self._prepare_weights(
            model_config.model, None, model_config.revision, False, None)
        if not use_safetensors:
            raise ValueError(f"k3client.vllm loads safetensors checkpoints; {model_config.model} has none")
        kept, experts = [], {}
        for path in weight_files:
            header, start = files.header(path)
            for key, info in header.items():
                m = EXPERT_KEY.search(key)
                if m:
                    experts.setdefault(int(m.group(1)), []).append((key, info["dtype"], tuple(info["shape"])))
                else:
                    kept.append((path, start, key, info))
        if not experts:
            raise FamilyError(f"{model_config.model}: no routed-expert tensors (layers.N. ... .experts.) in the "
                              "checkpoint; serve it without the k3d additional_config")
        self._k3d_plan = (files, kept)
        self._k3d_layers = sorted(experts)
        self._k3d_dir = os.path.dirname(weight_files[0])     # a hub id's snapshot directory
        return experts

    def create_model(self, vllm_config, model_config, prefix: str = ""):
        # DefaultModelLoader.load_model builds the model here and then reads its weights: with
        # the k3d key, the built experts layers are checked in between, before any tensor is read
        model = super().create_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
        if self._k3d_layers is not None:
            _check_built(model, self._k3d_layers)
        return model

    def get_all_weights(self, model_config, model):
        if self._k3d_plan is None:
            yield from super().get_all_weights(model_config, model)
            return
        files, kept = self._k3d_plan
        for path, start, key, info in kept:
            yield key, LazyTensor(files, path, start, info)._read()


def _tp_rank() -> tuple[int, int]:
    """This worker's (rank, size) in vLLM's tensor-parallel group; (0, 1) outside a distributed engine."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def _ep_refusal(vllm_config) -> str | None:
    """``ranks.ep_refusal`` of the engine: EP is on where its MoE group spans ranks (vLLM's rule:
    ``enable_expert_parallel`` and TP x DP x PCP > 1)."""
    pc = vllm_config.parallel_config
    group = pc.tensor_parallel_size * pc.data_parallel_size * getattr(pc, "prefill_context_parallel_size", 1)
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", None) or "cpu"
    return ranks.ep_refusal(str(device), bool(pc.enable_expert_parallel) and group > 1)


def _bind(model, client, st, checkpoint_layers: list[int], path: str, tp_rank: int = 0) -> Runtime:
    layers, modules = {}, {}
    for name, mod in model.named_modules():
        if not is_k3d(mod):
            continue
        layer = mod.k3d_layer
        specs = client.layout_of(layer)
        try:
            family = _family(mod, {s.name for s in specs})
        except FamilyError as e:
            raise FamilyError(f"model type {_model_type(model)!r}: {e}") from None
        layers[layer] = experts.layer(layer, mod, _router_of(model, name), family, specs)
        modules[layer] = mod
    on_cuda = cuda_devices(model)     # the device decides: a CPU engine on a GPU host keeps rowmm
    # tensor-parallel ranks see the same tokens and fetch the same experts: rank 0 alone sends the
    # gate-ahead predictions; expert-parallel ranks each predict the experts they compute
    use_ep = any(ml.mine is not None for ml in layers.values())
    predict = st.predict and (tp_rank == 0 or use_ep)
    rt = experts.runtime(client, layers, predict=predict, native_kernel=st.native and not on_cuda)
    rt.gpu.use(client, on_cuda)           # registered at load, not in the first step
    for layer, mod in modules.items():
        mod._k3d = (rt, layers[layer])
    return rt


def _check_built(model, checkpoint_layers: list[int]) -> None:
    """Refuse, before any weight is read, a model whose experts layers are not the plugin's:
    vLLM bypassed its out-of-tree registration (``guards.experts_refusal``), or built a family's
    experts with a ``RoutedExperts`` subclass the plugin does not replace."""
    built = [(n, type(m).__name__, is_k3d(m)) for n, m in model.named_modules() if isinstance(m, RoutedExperts)]
    refusal = guards.experts_refusal(built, REPLACED)
    if refusal:
        raise ValueError(refusal)
    mine = sorted({m.k3d_layer for m in model.modules() if is_k3d(m)})
    if mine != checkpoint_layers:
        own = sorted({cls for _, cls, k3d in built if not k3d})
        raise FamilyError(f"k3client.vllm cannot compute the experts of model type {_model_type(model)!r} "
                          f"(vLLM builds them with {', '.join(own) or 'no RoutedExperts'}; the checkpoint has "
                          f"routed experts in layers {checkpoint_layers}); {SUPPORTED}")


def _family(mod, names: set[str]):
    """The daemon's layout names as the math of ``mod``'s experts: gpt-oss's or the gated MLP's."""
    if not isinstance(mod, K3dGptOssRoutedExperts):
        return Standard(names)
    family = GptOss(names)
    built = getattr(mod, "k3d_mxfp4", False)      # built with an mxfp4 quantization_config (experts._quantized)
    if family.quantized and not built:
        # the model was built unquantized (no mxfp4 quantization_config), so vLLM would not run these
        raise FamilyError(f"gpt-oss experts in the daemon are MXFP4 ({sorted(names)}) but the model's config has "
                          "no mxfp4 quantization_config; serve the checkpoint the model is")
    if built and not family.quantized:
        raise FamilyError(f"the model's config quantizes gpt-oss's experts (mxfp4) but the daemon serves them "
                          f"unquantized ({sorted(names)}); serve the checkpoint the model is")
    return family


def _model_type(model) -> str:
    cfg = getattr(model, "config", None)
    return getattr(cfg, "model_type", type(model).__name__)


def install() -> None:
    # Overwriting a built-in format makes vLLM log a warning per format and
    # process; here that is the intended effect (this class is DefaultModelLoader
    # unless the model asks for k3d), so the warning would only mislead.
    log = logging.getLogger("vllm.model_executor.model_loader")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        for fmt in FORMATS:
            register_model_loader(fmt)(K3dLoader)
    finally:
        log.setLevel(level)
