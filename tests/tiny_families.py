"""Tiny MoE checkpoints written by transformers' own ``save_pretrained``, one per family.

``write(model_type, dir)`` builds the family's model from a tiny config (CPU, float32,
a few KB) and saves it; ``EXPECTED[model_type]`` says, independently of
``k3d.sources.families``, where that family's routed experts are on disk, so a test
can compare every served byte with ``safe_open``'s tensor or its ``[e]`` slice:

    (template, kind, layers)   template: tensor-name prefix with {l} (and {e} per expert)
                               kind: "per-expert" | "stacked" | "flat" (DBRX [E*I, H])
                               layers: the layers that hold routed experts

The configs use each family's own config.json keys for the expert count and top-k
(no extra keys), so the family rules are tested on what the family writes.
"""

from __future__ import annotations

import json
import os

E, TOP_K = 4, 2
_ATT = {"vocab_size": 64, "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1,
        "max_position_embeddings": 64}
_VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 32}


def _cfg(model_type):
    """(config, model class name) for one family; transformers imported lazily (optional extra)."""
    import transformers as T

    a = dict(_ATT)
    moe = {"num_experts": E, "num_experts_per_tok": TOP_K}
    local = {"num_local_experts": E, "num_experts_per_tok": TOP_K}
    routed = {"n_routed_experts": E, "num_experts_per_tok": TOP_K}
    c = {
        "qwen2_moe": lambda: (T.Qwen2MoeConfig(**a, **moe, num_hidden_layers=2, intermediate_size=32,
                                               moe_intermediate_size=16, shared_expert_intermediate_size=16),
                                                       "Qwen2MoeForCausalLM"),
        "qwen3_moe": lambda: (T.Qwen3MoeConfig(**a, **moe, num_hidden_layers=2, head_dim=16, intermediate_size=32,
                                               moe_intermediate_size=16), "Qwen3MoeForCausalLM"),
        "qwen3_next": lambda: (T.Qwen3NextConfig(**a, **moe, num_hidden_layers=2, head_dim=16, intermediate_size=32,
                                                 moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                                 linear_num_value_heads=2, linear_num_key_heads=2,
                                                 linear_key_head_dim=8, linear_value_head_dim=8,
                                                 layer_types=["linear_attention", "full_attention"]),
                                                         "Qwen3NextForCausalLM"),
        "qwen3_5_moe": lambda: (T.Qwen3_5MoeConfig(
            text_config=dict(**a, **moe, num_hidden_layers=2, head_dim=16, moe_intermediate_size=16,
                             shared_expert_intermediate_size=16, linear_num_value_heads=2, linear_num_key_heads=2,
                             linear_key_head_dim=8, linear_value_head_dim=8,
                             layer_types=["linear_attention", "full_attention"]),
            vision_config=_VISION),
            "Qwen3_5MoeForConditionalGeneration"),
        "olmoe": lambda: (T.OlmoeConfig(**a, **moe, num_hidden_layers=2, intermediate_size=16), "OlmoeForCausalLM"),
        "flex_olmo": lambda: (T.FlexOlmoConfig(**a, **moe, num_hidden_layers=2, intermediate_size=16, pad_token_id=1),
                              "FlexOlmoForCausalLM"),
        "deepseek_v2": lambda: (T.DeepseekV2Config(**a, **routed, num_hidden_layers=2, intermediate_size=32,
                                                   moe_intermediate_size=16, n_shared_experts=1,
                                                   first_k_dense_replace=1,
                                                   kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                                                   qk_nope_head_dim=8, v_head_dim=8), "DeepseekV2ForCausalLM"),
        "deepseek_v3": lambda: (T.DeepseekV3Config(**a, **routed, num_hidden_layers=3, intermediate_size=32,
                                                   moe_intermediate_size=16, n_shared_experts=1,
                                                   first_k_dense_replace=1,
                                                   n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16,
                                                   qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
                                "DeepseekV3ForCausalLM"),
        "glm4_moe": lambda: (T.Glm4MoeConfig(**a, **routed, num_hidden_layers=2, head_dim=16, intermediate_size=32,
                                             moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1,
                                             n_group=1, topk_group=1), "Glm4MoeForCausalLM"),
        "dots1": lambda: (T.Dots1Config(**a, **routed, num_hidden_layers=2, head_dim=16, intermediate_size=32,
                                        moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=0,
                                        n_group=1, topk_group=1), "Dots1ForCausalLM"),
        "ernie4_5_moe": lambda: (T.Ernie4_5_MoeConfig(**a, num_hidden_layers=2, intermediate_size=32,
                                                      moe_intermediate_size=16, moe_num_experts=E, moe_k=TOP_K,
                                                      moe_num_shared_experts=1, moe_layer_start_index=1),
                                 "Ernie4_5_MoeForCausalLM"),
        "hunyuan_v1_moe": lambda: (T.HunYuanMoEV1Config(**a, num_hidden_layers=2, head_dim=16, intermediate_size=32,
                                                        num_experts=E, moe_topk=TOP_K), "HunYuanMoEV1ForCausalLM"),
        "afmoe": lambda: (T.AfmoeConfig(**a, **moe, num_hidden_layers=2, head_dim=16, intermediate_size=32,
                                        moe_intermediate_size=16, num_dense_layers=1, num_shared_experts=1),
                          "AfmoeForCausalLM"),
        "exaone_moe": lambda: (T.ExaoneMoeConfig(**a, **moe, num_hidden_layers=2, head_dim=16, intermediate_size=32,
                                                 moe_intermediate_size=16, first_k_dense_replace=1,
                                                 num_shared_experts=1), "ExaoneMoeForCausalLM"),
        "cohere2_moe": lambda: (T.Cohere2MoeConfig(**a, **moe, num_hidden_layers=2, head_dim=16, intermediate_size=16),
                                "Cohere2MoeForCausalLM"),
        "mixtral": lambda: (T.MixtralConfig(**a, **local, num_hidden_layers=2, head_dim=16, intermediate_size=16),
                            "MixtralForCausalLM"),
        "phimoe": lambda: (T.PhimoeConfig(**a, **local, num_hidden_layers=2, intermediate_size=16),
                "PhimoeForCausalLM"),
        "minimax": lambda: (T.MiniMaxConfig(**a, **local, num_hidden_layers=2, head_dim=16, intermediate_size=16),
                            "MiniMaxForCausalLM"),
        "minimax_m2": lambda: (T.MiniMaxM2Config(**a, **local, num_hidden_layers=2, head_dim=16, intermediate_size=16),
                               "MiniMaxM2ForCausalLM"),
        "jamba": lambda: (T.JambaConfig(**a, **moe, num_hidden_layers=4, intermediate_size=16, attn_layer_period=2,
                                        attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                                        mamba_d_state=4, mamba_expand=1, use_mamba_kernels=False), "JambaForCausalLM"),
        "lfm2_moe": lambda: (T.Lfm2MoeConfig(**a, **moe, num_hidden_layers=3, intermediate_size=32,
                                             moe_intermediate_size=16, num_dense_layers=1,
                                             layer_types=["conv", "full_attention", "conv"]), "Lfm2MoeForCausalLM"),
        "deepseek_v4": lambda: (T.DeepseekV4Config(**a, **routed, num_hidden_layers=2, moe_intermediate_size=32),
                                "DeepseekV4ForCausalLM"),
        "gpt_oss": lambda: (T.GptOssConfig(**a, **local, num_hidden_layers=2, head_dim=16, intermediate_size=16),
                            "GptOssForCausalLM"),
        "qwen3_vl_moe": lambda: (T.Qwen3VLMoeConfig(
            text_config=dict(**a, **moe, num_hidden_layers=2, head_dim=16, intermediate_size=32,
                             moe_intermediate_size=16),
            vision_config={**_VISION,
                               "deepstack_visual_indexes": []}), "Qwen3VLMoeForConditionalGeneration"),
        "llama4": lambda: (T.Llama4Config(
            text_config=dict(**a, num_local_experts=E, num_experts_per_tok=1, num_hidden_layers=2, head_dim=16,
                             intermediate_size=16, intermediate_size_mlp=32),
            vision_config={"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                               "vision_output_dim": 32, "projector_input_dim": 32, "projector_output_dim": 32,
                               "image_size": 32, "patch_size": 16}), "Llama4ForConditionalGeneration"),
        "llama4_text": lambda: (T.Llama4TextConfig(**a, num_local_experts=E, num_experts_per_tok=1, num_hidden_layers=2,
                                                   head_dim=16, intermediate_size=16, intermediate_size_mlp=32),
                                "Llama4ForCausalLM"),
        "granitemoe": lambda: (T.GraniteMoeConfig(**a, **local, num_hidden_layers=2, intermediate_size=16),
                               "GraniteMoeForCausalLM"),
        "jetmoe": lambda: (T.JetMoeConfig(**{k: v for k, v in a.items() if k != "num_key_value_heads"}, **local,
                                          num_key_value_heads=1, kv_channels=16, num_hidden_layers=2,
                                          intermediate_size=16), "JetMoeForCausalLM"),
        "dbrx": lambda: (T.DbrxConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=64,
                                      attn_config={"kv_n_heads": 1, "rope_theta": 10000.0},
                                      ffn_config={"ffn_hidden_size": 16, "moe_num_experts": E, "moe_top_k": TOP_K}),
                         "DbrxForCausalLM"),
    }[model_type]
    return c()


_MLP = ("model.layers.{l}.mlp.experts.{e}.", "per-expert")
EXPECTED: dict[str, tuple[str, str, list[int]]] = {
    **{mt: (*_MLP, [0, 1]) for mt in ("qwen2_moe", "qwen3_moe", "qwen3_next", "olmoe", "flex_olmo", "dots1",
                                      "hunyuan_v1_moe", "cohere2_moe")},
    "qwen3_5_moe": ("model.language_model.layers.{l}.mlp.experts.{e}.", "per-expert", [0, 1]),
    **{mt: (*_MLP, [1]) for mt in ("deepseek_v2", "glm4_moe", "ernie4_5_moe", "afmoe", "exaone_moe")},
    "deepseek_v3": (*_MLP, [1, 2]),
    **{mt: ("model.layers.{l}.block_sparse_moe.experts.{e}.", "per-expert", [0, 1])
       for mt in ("mixtral", "phimoe", "minimax", "minimax_m2")},
    "jamba": ("model.layers.{l}.feed_forward.experts.{e}.", "per-expert", [1, 3]),
    "lfm2_moe": ("model.layers.{l}.feed_forward.experts.{e}.", "per-expert", [1, 2]),
    "deepseek_v4": ("model.layers.{l}.ffn.experts.{e}.", "per-expert", [0, 1]),
    "gpt_oss": ("model.layers.{l}.mlp.experts.", "stacked", [0, 1]),
    "qwen3_vl_moe": ("model.language_model.layers.{l}.mlp.experts.", "stacked", [0, 1]),
    "llama4": ("language_model.model.layers.{l}.feed_forward.experts.", "stacked", [0, 1]),
    "llama4_text": ("model.layers.{l}.feed_forward.experts.", "stacked", [0, 1]),
    "granitemoe": ("model.layers.{l}.block_sparse_moe.", "stacked", [0, 1]),
    "jetmoe": ("model.layers.{l}.mlp.", "stacked", [0, 1]),
    "dbrx": ("transformer.blocks.{l}.ffn.experts.mlp.", "flat", [0, 1]),
}
# the stacked families' expert tensors (what follows the prefix); everything else there is not an expert
STACKED_NAMES = {
    "gpt_oss": {"gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"},
    "qwen3_vl_moe": {"gate_up_proj", "down_proj"},
    "llama4": {"gate_up_proj", "down_proj"},
    "llama4_text": {"gate_up_proj", "down_proj"},
    "granitemoe": {"input_linear.weight", "output_linear.weight"},
    "jetmoe": {"input_linear.weight", "output_linear.weight"},
    "dbrx": {"w1", "v1", "w2"},
}
# what model.family reports (config.json's model_type, with the *_text variants folded)
FAMILY_NAME = {"llama4_text": "llama4"}


def write(model_type: str, out: str, seed: int = 0) -> str:
    """Save the family's tiny model to ``out`` with ``save_pretrained``; returns ``out``."""
    import torch
    import transformers as T

    torch.manual_seed(seed)
    cfg, cls = _cfg(model_type)
    model = getattr(T, cls)(cfg)
    model.save_pretrained(out)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["model_type"] in (model_type, "llama4_text"), "unexpected model_type"
    return out
