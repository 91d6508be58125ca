"""A layer's pins end with its compute: ``k3client.hf``'s runtime releases each layer it computed.

A real ``k3d start`` whose arena holds one layer's experts (8 slots, top-2 of 8): with
releases each layer's pins go once it ran, so a forward needs no epoch beyond its own
where, with ``K3D_RELEASE_LAYERS=0``, every layer after the first begins one.  The logits
equal transformers' eager experts either way.
"""

from hf_common import checkpoint, daemon_args, eager, prompt, torch
from test_hf_arena import _slot_arena


def _run(path, endpoint, ref, ids):
    from k3client.hf import load_model

    model = load_model(path, endpoint=endpoint, dtype=torch.bfloat16, predict=False)
    try:
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(ref(ids).logits, model(ids).logits)
        st = model.k3d.stats
        return st, len(model.k3d.layers), model.k3d.client.status()["stats"]
    finally:
        model.k3d.client.close()


def test_layers_released_as_computed_save_the_mid_forward_epochs(start_daemon, monkeypatch):
    path = checkpoint("qwen3_moe")
    d = start_daemon(path, *daemon_args("qwen3_moe", arena=_slot_arena(path, "qwen3_moe", 8)))
    ref = eager(path)
    ids = prompt(batch=2, length=9)          # routes to (nearly) all 8 experts per layer
    on, layers, daemon_on = _run(path, d.endpoint, ref, ids)
    assert layers > 1
    assert on.layers_released == on.forwards * (layers - 1)      # every layer but the last
    assert daemon_on["layers_done"] == on.layers_released and daemon_on["pins_done"] > 0
    assert on.epochs == on.forwards and on.cache_full_retries == 0
    monkeypatch.setenv("K3D_RELEASE_LAYERS", "0")
    off, _, daemon_off = _run(path, d.endpoint, ref, ids)
    assert off.layers_released == 0 and daemon_off["layers_done"] == daemon_on["layers_done"]
    assert off.epochs > off.forwards                             # a new epoch inside each forward
