"""GPU hosts only (skipped without CUDA): the arena is pinned host memory, experts compute on the device.

Written to run as one short script on a lent GPU machine:
``python -m pytest -q tests/integration/test_hf_gpu.py``.
"""

import pytest
from hf_common import checkpoint, daemon_args, eager, prompt, torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this host)")


def test_arena_registered_once_and_compute_on_device(start_daemon):
    from k3client.hf import gpu, load_model

    path = checkpoint("qwen3_moe")
    d = start_daemon(path, *daemon_args("qwen3_moe"))
    ref = eager(path).to("cuda")
    model = load_model(path, endpoint=d.endpoint, dtype=torch.bfloat16).to("cuda")
    try:
        ids = prompt().to("cuda")
        with torch.no_grad():
            a, b = ref(ids).logits, model(ids).logits
        mm = model.k3d.client._mm
        assert gpu.is_registered(mm)
        # a view of a registered mapping is page-locked: its H2D copies are truly asynchronous
        ml = next(iter(model.k3d.layers.values()))
        ex = model.k3d.client.fetch(ml.layer, [0])[0]
        assert ex.tensor(ml.names[0]).is_pinned()
        assert b.device.type == "cuda"
        # same math on the device; GPU kernels need not be bit-equal across batch shapes, so: close
        assert torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2)
        g_ref = ref.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        g_k3d = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert g_ref.shape == g_k3d.shape
        # registration happens once per mapping, not per forward
        before = dict(gpu._registered)
        with torch.no_grad():
            model(ids)
        assert gpu._registered == before
    finally:
        model.k3d.client.close()
