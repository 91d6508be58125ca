"""Tiny MoE checkpoints that vLLM's CPU engine can run, written by transformers' ``save_pretrained``.

``hf_models``' configs are too small for vLLM's CPU attention kernels (head sizes
of 32..512 for MHA; MLA only with a 576 latent: ``kv_lora_rank`` 512 plus a rope
dim of 64), and transformers' DeepSeek-V3 config omits the ``topk_method`` and
``scoring_func`` keys that vLLM reads (DeepSeek's own config.json ships them).
``write(family, out_dir)`` is ``hf_models.write`` with those fields set; random
bf16 weights, fixed seed; ``gpt_oss_mxfp4`` is ``hf_models.write_gpt_oss_mxfp4`` (MXFP4
experts, as openai ships gpt-oss).  Used by the vLLM tests and ``bench/vllm_overhead.py``.
torch and transformers are imported inside (the ``hf``/``vllm`` extras).
"""

from __future__ import annotations

# model_type -> config fields on top of hf_models.config(family, hidden=HIDDEN)
HIDDEN = 128                       # 4 heads of 32 where head_dim follows hidden
OVERRIDES = {
    "qwen3_moe": {"head_dim": 32},
    "mixtral": {},
    "deepseek_v3": {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "kv_lora_rank": 512,
                    "qk_rope_head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 32, "qk_head_dim": 96,
                    "head_dim": 64},
    "gpt_oss": {"head_dim": 32},
    "gpt_oss_mxfp4": {"head_dim": 32},    # gpt-oss as openai ships it (hf_models.write_gpt_oss_mxfp4)
}


def write(family: str, out_dir: str, seed: int = 0, hidden: int = HIDDEN, inter: int = 32, layers: int = 3,
          experts: int | None = None, **fields) -> str:
    """A tiny random ``family`` model saved at ``out_dir`` (bf16, one safetensors file)."""
    from . import hf_models

    if family not in OVERRIDES:
        raise ValueError(f"no vLLM-CPU tiny config for {family!r}; have {sorted(OVERRIDES)}")
    if family == "gpt_oss_mxfp4":
        return hf_models.write_gpt_oss_mxfp4(out_dir, seed=seed, fields={**OVERRIDES[family], **fields},
                                             hidden=hidden, inter=inter, layers=layers, experts=experts)
    return hf_models.write(family, out_dir, seed=seed, fields={**OVERRIDES[family], **fields},
                           hidden=hidden, inter=inter, layers=layers, experts=experts)
