"""Arenas smaller than the work, and gate-ahead predictions on and off."""

import pytest
from hf_common import checkpoint, daemon_args, eager, prompt, torch

import k3client


def _slot_arena(path, family, slots):
    """An --arena of exactly ``slots`` slots of this checkpoint (slot = 4096-aligned expert)."""
    from transformers import AutoConfig

    from k3d.demo.hf_models import expert_bytes

    cfg = AutoConfig.from_pretrained(path)
    n = cfg.num_hidden_layers * (getattr(cfg, "num_experts", None) or cfg.num_local_experts)
    per = expert_bytes(path) // n
    slot = (per + 4095) // 4096 * 4096
    return slots * slot


@pytest.mark.parametrize("slots", [2, 1])
def test_arena_of_top_k_or_less_still_exact(start_daemon, slots):
    """top-k = 2: a 2-slot arena holds one token's experts of one layer; 1 slot holds less."""
    from k3client.hf import load_model

    path = checkpoint("qwen3_moe")
    d = start_daemon(path, *daemon_args("qwen3_moe", arena=_slot_arena(path, "qwen3_moe", slots)))
    ref = eager(path)
    model = load_model(path, endpoint=d.endpoint, dtype=torch.bfloat16)
    try:
        assert model.k3d.client.slots == slots
        ids = prompt(batch=2, length=9)     # routes to (nearly) all 8 experts per layer
        with torch.no_grad():
            assert torch.equal(ref(ids).logits, model(ids).logits)
        g_ref = ref.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(g_ref, model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0))
        st = model.k3d.stats
        assert st.epochs > st.forwards            # new epochs between groups inside forwards
        assert st.cache_full_retries == 0         # planned from the slot count: never refused
        assert model.k3d.client.status()["stats"]["errors"] == 0
    finally:
        model.k3d.client.close()


def test_predictions_sent_with_fetch_and_switchable(start_daemon):
    from k3client.hf import load_model

    path = checkpoint("mixtral")
    d = start_daemon(path, *daemon_args("mixtral", arena="8MiB"))
    ids = prompt(batch=1, length=5)
    on = load_model(path, endpoint=d.endpoint, name="on", dtype=torch.bfloat16)
    try:
        on.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
        st = on.k3d.stats
        layers = len(on.k3d.layers)
        # every forward predicts for every MoE layer but the last; decode predicts top-k per token
        assert st.predicted >= st.forwards * (layers - 1) * 2
        assert 0 <= st.predicted_used <= st.predicted
        assert st.fetches == st.forwards * layers      # predictions travel inside the fetches
        prefetched_on = on.k3d.client.status()["stats"]["prefetched"]
    finally:
        on.k3d.client.close()
    d2 = start_daemon(path, *daemon_args("mixtral", arena="8MiB"))
    off = load_model(path, endpoint=d2.endpoint, name="off", predict=False, dtype=torch.bfloat16)
    try:
        off.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert off.k3d.stats.predicted == 0
        with k3client.connect(d2.endpoint) as c:
            assert c.status()["stats"]["prefetched"] == 0
    finally:
        off.k3d.client.close()
    assert prefetched_on > 0
