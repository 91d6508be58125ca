"""Tiny MoE checkpoints written by transformers' own ``save_pretrained`` (random weights).

Used by ``k3d demo --hf``, ``examples/hf_generate.py``, ``bench/hf_overhead.py``
and the tests.  ``write(family, out_dir, **sizes)`` builds the family's model
from a tiny config in bf16 with a fixed seed and saves it as it ships (each
family's own on-disk layout: per-expert ``w1/w2/w3`` or ``gate/up/down_proj``,
stacked ``gate_up_proj`` or ``input_linear``).  ``write_gpt_oss_mxfp4`` writes a
gpt-oss checkpoint in the MXFP4 layout openai ships (``_blocks``/``_scales`` U8,
``quantization_config`` mxfp4), by hand, since ``save_pretrained`` cannot
quantize on a CPU.

Random weights route nothing like trained ones (near-uniform over experts, no
temporal reuse): hit rates and prediction figures measured on these models say
how the machinery behaves, not what a real model gets.

torch, transformers and safetensors' torch API are the ``hf`` extra: imported
inside the functions so ``k3d`` itself never needs them.
"""

from __future__ import annotations

import json
import os

# model_type -> config fields beyond COMMON (kept tiny; `sizes` scale hidden/inter)
FAMILIES = {
    "mixtral": {"intermediate_size": "inter", "num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen2_moe": {"intermediate_size": "inter2", "moe_intermediate_size": "inter",
                      "shared_expert_intermediate_size": "inter", "num_experts": 8, "num_experts_per_tok": 2,
                      "decoder_sparse_step": 1},
    "qwen3_moe": {"intermediate_size": "inter2", "moe_intermediate_size": "inter", "num_experts": 8,
                      "num_experts_per_tok": 2, "head_dim": 16},
    "deepseek_v3": {"intermediate_size": "inter2", "moe_intermediate_size": "inter", "n_routed_experts": 8,
                        "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2,
                        "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
                        "qk_nope_head_dim": 8, "v_head_dim": 16,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "gpt_oss": {"intermediate_size": "inter", "num_local_experts": 8, "num_experts_per_tok": 2, "head_dim": 16,
                    "sliding_window": 16},
    "olmoe": {"intermediate_size": "inter", "num_experts": 8, "num_experts_per_tok": 2},
    "phimoe": {"intermediate_size": "inter", "num_local_experts": 8, "num_experts_per_tok": 2},
    "granitemoe": {"intermediate_size": "inter", "num_local_experts": 8, "num_experts_per_tok": 2},
}
COMMON = {"vocab_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
              "tie_word_embeddings": False}


def config(family: str, hidden: int = 64, inter: int = 32, layers: int = 3, experts: int | None = None):
    from transformers import AutoConfig  # optional extra (hf)

    if family not in FAMILIES:
        raise ValueError(f"unknown tiny family {family!r}; have {sorted(FAMILIES)}")
    fields = dict(COMMON, hidden_size=hidden, num_hidden_layers=layers)
    sizes = {"inter": inter, "inter2": 2 * inter}
    for k, v in FAMILIES[family].items():
        fields[k] = sizes.get(v, v) if isinstance(v, str) else v
    if experts is not None:
        for k in ("num_local_experts", "num_experts", "n_routed_experts"):
            if k in fields:
                fields[k] = experts
    return AutoConfig.for_model(family, **fields)


def write(family: str, out_dir: str, seed: int = 0, fields: dict | None = None, **sizes) -> str:
    """Save a random tiny ``family`` model (bf16) with ``save_pretrained``; returns ``out_dir``.
    ``fields``: config fields set over ``config(family, **sizes)``'s."""
    import torch  # optional extra (hf)
    from transformers import AutoModelForCausalLM

    cfg = config(family, **sizes)
    for k, v in (fields or {}).items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():       # some inits leave zeros (routers, biases): give every tensor signal
        for p in model.parameters():
            if p.dim() == 1 and not p.abs().sum():
                p.normal_(0, 0.02)
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()     # its "Writing model shards" bar would run into the demo's output
    try:
        model.save_pretrained(out_dir)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    return out_dir


def write_gpt_oss_mxfp4(out_dir: str, seed: int = 0, fields: dict | None = None, **sizes) -> str:
    """A gpt-oss checkpoint as openai ships it: experts in MXFP4 ``_blocks``/``_scales``."""
    import torch  # optional extra (hf)
    from safetensors.torch import load_file, save_file

    write("gpt_oss", out_dir, seed=seed, fields=fields, **sizes)
    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    g = torch.Generator().manual_seed(seed + 1)
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = tensors.pop(key)                       # [E, in, out] in memory order
        e, k_in, out = w.shape
        blocks = torch.randint(0, 256, (e, out, k_in // 32, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(118, 128, (e, out, k_in // 32), dtype=torch.uint8, generator=g)
        tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
    save_file(tensors, path, metadata={"format": "pt"})
    cfg_path = os.path.join(out_dir, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    return out_dir


def expert_bytes(path: str) -> int:
    """Bytes of all routed-expert tensors in a checkpoint (headers only)."""
    from safetensors import safe_open

    total = 0
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "np") as f:
                for k in f.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                    if ".experts." in k or "input_linear" in k or "output_linear" in k:
                        sl = f.get_slice(k)
                        n = 1
                        for d in sl.get_shape():
                            n *= d
                        total += n * (1 if sl.get_dtype() in ("U8", "I8") else 2 if "16" in sl.get_dtype() else 4)
    return total


def split_experts(src: str, dst: str) -> str:
    """``src`` with its routed-expert tensors in a shard of their own (``experts.safetensors``) at ``dst``."""
    import shutil

    from safetensors.torch import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    experts = {k: v for k, v in tensors.items() if ".experts." in k}
    rest = {k: v for k, v in tensors.items() if k not in experts}
    save_file(rest, os.path.join(dst, "rest.safetensors"), metadata={"format": "pt"})
    save_file(experts, os.path.join(dst, "experts.safetensors"), metadata={"format": "pt"})
    wm = {k: "rest.safetensors" for k in rest} | {k: "experts.safetensors" for k in experts}
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": wm}, f)
    for name in ("config.json", "generation_config.json"):
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    return dst
