"""k3client.hf computes each family's experts from arena views: logits equal eager bit for bit.

One real daemon per family serves a tiny checkpoint written by ``save_pretrained``;
the reference is the same checkpoint loaded by transformers with
``experts_implementation="eager"`` in this process.
"""

import pytest
from hf_common import checkpoint, daemon_args, eager, prompt, torch

# the four families first supported, then two computed because their eager loop is Mixtral's (checked by source)
FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "olmoe", "phimoe"]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_greedy_generate_equal_eager(start_daemon, family):
    from k3client.hf import load_model

    path = checkpoint(family)
    d = start_daemon(path, *daemon_args(family))
    ref = eager(path)
    model = load_model(path, endpoint=d.endpoint, dtype=torch.bfloat16)
    try:
        ids = prompt()
        with torch.no_grad():
            a, b = ref(ids).logits, model(ids).logits
        assert a.dtype == b.dtype == torch.bfloat16
        assert torch.equal(a, b), f"{family}: max |diff| {(a.float() - b.float()).abs().max().item()}"
        g_ref = ref.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        g_k3d = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(g_ref, g_k3d)
        st = model.k3d.stats
        assert st.forwards == 1 + 6 and st.epochs >= st.forwards
        assert st.experts_fetched > 0 and st.predicted > 0
        # the routed experts are not in the process: meta tensors, not parameters
        names = {n for n, _ in model.named_parameters()}
        for ml in model.k3d.layers.values():
            for attr in ("gate_up_proj", "down_proj"):
                assert getattr(ml.module, attr).device.type == "meta"
            assert not any(n.startswith(_qualname(model, ml.module)) for n in names)
    finally:
        model.k3d.client.close()


def _qualname(model, module) -> str:
    return next(n for n, m in model.named_modules() if m is module) + "."
