"""GPU hosts only (skipped without CUDA): the arena is pinned host memory, experts compute on the device.

Written to run as one short script on a lent GPU machine:
``python -m pytest -q tests/integration/test_hf_gpu.py``.
"""

import warnings

import pytest
from hf_common import checkpoint, daemon_args, eager, prompt, torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this host)")

TOL = 2e-2      # GPU kernels need not be bit-equal across batch shapes: logits agree this closely


def assert_same_greedy_tokens(ref, ids, g_ref, g_k3d):
    """``g_k3d`` is ``g_ref``, token for token; where a row first differs, eager's own
    logits there must be a near tie (within TOL) between the two tokens, which the
    GPU's rounding may break either way.  Tokens after that point are not comparable."""
    assert g_ref.shape == g_k3d.shape
    for row in range(g_ref.shape[0]):
        differ = (g_ref[row] != g_k3d[row]).nonzero()
        if not len(differ):
            continue
        at = int(differ[0])
        assert at >= ids.shape[1], f"row {row}: the prompt itself changed at {at}"
        with torch.no_grad():
            logits = ref(g_ref[row:row + 1, :at]).logits[0, -1].float()
        mine, theirs = int(g_ref[row, at]), int(g_k3d[row, at])
        assert logits[mine] - logits[theirs] <= TOL * max(1.0, abs(float(logits[mine]))), (
            f"row {row}, position {at}: k3d chose token {theirs} where eager chose {mine} "
            f"by a margin of {float(logits[mine] - logits[theirs]):.4f}")


def test_arena_registered_once_and_compute_on_device(start_daemon):
    from k3client.hf import load_model

    path = checkpoint("qwen3_moe")
    d = start_daemon(path, *daemon_args("qwen3_moe"))
    ref = eager(path).to("cuda")
    model = load_model(path, endpoint=d.endpoint, dtype=torch.bfloat16).to("cuda")
    try:
        ids = prompt().to("cuda")
        with torch.no_grad():
            a, b = ref(ids).logits, model(ids).logits
        # the arena is registered: a view of it is page-locked, so H2D copies are asynchronous
        ml = next(iter(model.k3d.layers.values()))
        ex = model.k3d.client.fetch(ml.layer, [0])[0]
        assert ex.tensor(ml.names[0]).is_pinned()
        assert b.device.type == "cuda"
        assert torch.allclose(a.float(), b.float(), atol=TOL, rtol=TOL)
        g_ref = ref.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        g_k3d = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert_same_greedy_tokens(ref, ids, g_ref, g_k3d)
        # registered once per mapping, not per forward: a second registration of the same
        # memory would fail in CUDA, and a failed registration warns
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="k3client.hf: cudaHostRegister")
            with torch.no_grad():
                model(ids)
        assert model.k3d.client.fetch(ml.layer, [0])[0].tensor(ml.names[0]).is_pinned()
    finally:
        model.k3d.client.close()
