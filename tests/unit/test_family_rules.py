"""Unit: the family rules (k3d.sources.families) on plain names, shapes and config dicts."""

import pytest

from k3d.sources.families import (
    FAMILIES,
    RULES,
    FamilyError,
    expert_pieces,
    no_match_hint,
    read_config,
    settle,
    suggest_pattern,
)


def _t(shape, dtype="F32", off=0):
    n = 4
    for d in shape:
        n *= d
    return (dtype, tuple(shape), 0, off, n)


def test_every_family_names_a_rule():
    assert set(FAMILIES.values()) <= set(RULES)
    assert all(FAMILIES[mt] == "experts.mlp" for mt in ("qwen3_moe", "deepseek_v3", "glm4_moe"))


@pytest.mark.parametrize("cfg,want", [
    ({"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2}, ("mixtral", 8, 2)),
    ({"model_type": "deepseek_v3", "n_routed_experts": 256, "num_experts_per_tok": 8}, ("deepseek_v3", 256, 8)),
    ({"model_type": "ernie4_5_moe", "moe_num_experts": 64, "moe_k": 6}, ("ernie4_5_moe", 64, 6)),
    ({"model_type": "hunyuan_v1_moe", "num_experts": 16, "moe_topk": [8, 8]}, ("hunyuan_v1_moe", 16, 8)),
    ({"model_type": "dbrx", "ffn_config": {"moe_num_experts": 16, "moe_top_k": 4}}, ("dbrx", 16, 4)),
    ({"model_type": "llama4", "text_config": {"num_local_experts": 16, "num_experts_per_tok": 1}}, ("llama4", 16, 1)),
    ({"model_type": "llama4_text", "num_local_experts": 16}, ("llama4", 16, None)),
    ("not a dict", (None, None, None)),
])
def test_read_config(cfg, want):
    mc = read_config(cfg)
    assert (mc.model_type, mc.experts, mc.top_k) == want


def test_names_alone():
    names = [f"model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight" for l in range(2) for e in range(3)]
    fam = settle("ck", None, names + ["model.layers.0.block_sparse_moe.gate.weight"])
    assert fam.name == "experts.block_sparse_moe" and fam.how == "tensor names"


def test_two_families_matching_is_one_line():
    names = ["model.layers.0.mlp.experts.0.gate_proj.weight", "model.layers.0.feed_forward.experts.gate_up_proj"]
    with pytest.raises(FamilyError, match=r"two families match this checkpoint: experts.mlp \('model.layers.0.mlp"
                                          r".*'\) and stacked.feed_forward \('model.layers.0.feed_forward"):
        settle("ck", None, names)


def test_nothing_matches_hints_a_pattern():
    names = ["transformer.h.0.attn.q.weight"] + [f"transformer.h.{l}.moe.experts.{e}.w1.weight"
                                                   for l in range(3) for e in range(2)]
    with pytest.raises(FamilyError, match=r"first tensors: transformer.h.0.attn.q.weight, .*; try --pattern "
                                          r"'transformer.h.\{layer\}.moe.experts.\{expert\}.\{name\}'"):
        settle("ck", {"model_type": "llama"}, names)
    assert suggest_pattern(["a.b"]) is None
    assert "pass --pattern" in no_match_hint(["lm_head.weight"])


def test_stacked_slices_and_counts():
    t = {"model.layers.0.mlp.experts.gate_up_proj": _t((4, 8, 16)),
         "model.layers.0.mlp.experts.gate_up_proj_bias": _t((4, 16), off=4 * 8 * 16 * 4),
         "model.layers.0.mlp.router.weight": _t((4, 8))}
    fam = settle("ck", None, t)
    pieces = expert_pieces("ck", fam, t, lambda d: 4)
    assert sorted(pieces) == [(0, e) for e in range(4)]
    d, shape, fi, off, n, name = pieces[(0, 2)]["gate_up_proj"]
    assert shape == (8, 16) and off == 2 * 8 * 16 * 4 and n == 8 * 16 * 4
    assert set(pieces[(0, 0)]) == {"gate_up_proj", "gate_up_proj_bias"}
    bad = dict(t, **{"model.layers.1.mlp.experts.gate_up_proj": _t((3, 8, 16))})
    with pytest.raises(FamilyError, match="disagree on the expert count"):
        expert_pieces("ck", settle("ck", None, bad), bad, lambda d: 4)


def test_dbrx_needs_its_config():
    t = {"transformer.blocks.0.ffn.experts.mlp.w1": _t((64, 32))}
    with pytest.raises(FamilyError, match=r"\[E\*I, H\]; the expert count E comes from config.json"):
        expert_pieces("ck", settle("ck", None, t), t, lambda d: 4)
    fam = settle("ck", {"model_type": "dbrx", "ffn_config": {"moe_num_experts": 4}}, t)
    pieces = expert_pieces("ck", fam, t, lambda d: 4)
    assert pieces[(0, 3)]["w1"][1] == (16, 32) and pieces[(0, 3)]["w1"][3] == 3 * 16 * 32 * 4
