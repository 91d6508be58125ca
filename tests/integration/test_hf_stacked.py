"""Stacked-expert families (served by the daemon's family rules, no --pattern): gpt-oss bf16,
gpt-oss MXFP4 as shipped, GraniteMoE; logits equal eager bit for bit, greedy generate equal.

The MXFP4 reference is transformers' own dequantizing loader (``Mxfp4Config(dequantize=True)``);
k3d dequantizes each fetched expert from its ``_blocks``/``_scales`` views.
"""

import pytest
from hf_common import checkpoint, eager, prompt, torch


@pytest.mark.parametrize("family", ["gpt_oss", "gpt_oss_mxfp4", "granitemoe"])
def test_stacked_family_equals_eager(start_daemon, family):
    from k3client.hf import load_model

    path = checkpoint(family)
    d = start_daemon(path, "--arena", "8MiB")
    ref = eager(path)
    model = load_model(path, endpoint=d.endpoint, dtype=torch.bfloat16)
    try:
        names = {s.name for s in model.k3d.client.layout}
        if family == "gpt_oss_mxfp4":
            assert {"gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks"} <= names
            assert next(iter(model.k3d.layers.values())).family.quantized
        ids = prompt()
        with torch.no_grad():
            a, b = ref(ids).logits, model(ids).logits
        assert torch.equal(a, b), f"{family}: max |diff| {(a.float() - b.float()).abs().max().item()}"
        g_ref = ref.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(g_ref, model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0))
        assert model.k3d.stats.predicted > 0
    finally:
        model.k3d.client.close()
