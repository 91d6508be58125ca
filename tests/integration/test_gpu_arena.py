"""The arena's registration across a real daemon's restarts, with a stand-in of the CUDA calls.

A real ``k3d start`` and a real client; only the CUDA calls are ``FakeCuda``
(tests/fake_cuda.py), which keeps the driver's rules: a range overlapping a live
registration is refused (712) and a registration outlives ``munmap``.  So a client
that kept the old arena registered, or keyed it by address, fails here the way it
would copy a dead arena's bytes on a GPU.
"""

import tempfile
import warnings

import pytest
import torch

import k3client
from conftest import SCRATCH
from fake_cuda import FakeCuda
from helpers import reference, verify
from k3client.gpu import pinning
from k3client.hf.gpu import GpuSide
from k3client.runtime import Runtime, compute

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)


def endpoint():
    return f"ipc://{tempfile.mkdtemp(prefix='k3d-g-', dir=SCRATCH)}/k.sock"


def arena_chunks(c) -> list[tuple[int, int]]:
    base = pinning.address_of(c.arena)
    return [(base + off, n) for off, n in pinning.plan_chunks(len(c.arena), c.slot_bytes, pinning.CHUNK_LIMIT)]


def test_unregistered_before_unmap_and_registered_again_after_a_restart(checkpoint, start_daemon, monkeypatch):
    monkeypatch.setattr(pinning, "CHUNK_LIMIT", 4 * 2**20)     # several chunks of this small arena
    ep = endpoint()
    d = start_daemon(checkpoint, "--slots", "16", endpoint=ep)
    fake = FakeCuda()
    ref = reference(checkpoint)
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # no registration may fail (712: the old one left)
        c = k3client.connect(ep, name="gpu-arena", reconnect_timeout=20)
        try:
            g = GpuSide(c, api_factory=lambda: fake)
            g.use(c, [CUDA0])
            first = arena_chunks(c)
            assert len(first) > 1 and fake.live == dict(first)
            verify(c, c.fetch(0, [1, 2]), ref)
            assert d.stop() == 0
            d = start_daemon(checkpoint, "--slots", "16", endpoint=ep)
            exs = c.fetch(0, [3])                # re-attaches: the old arena is unmapped here
            assert c.restarts == 1
            unregs = fake.of("unregister")
            assert sorted((a, n) for _, a, n, _, _ in unregs) == sorted(first)
            assert all(still_mapped for _, _, _, still_mapped, _ in unregs), "unregistered after the unmap"
            i = fake.calls.index(unregs[0])
            assert fake.calls[i - 1][0] == "synchronize", "unregistered while copies could be queued"
            g.follow(c)                          # the runtime's restart check
            second = arena_chunks(c)
            assert fake.live == dict(second)     # the new mapping, even at the old address
            print(f"old arena at {first[0][0]:#x}, new at {second[0][0]:#x}")
            verify(c, exs, ref)
        finally:
            c.close()
    assert fake.live == {}, "close() left the arena registered"
    assert all(err == 0 for *_, err in fake.of("register") + fake.of("unregister"))
    assert d.stop() == 0


def test_each_device_is_synchronised_before_the_epoch_ends(checkpoint, start_daemon):
    d = start_daemon(checkpoint, "--slots", "16")
    fake = FakeCuda()
    with k3client.connect(d.endpoint, name="gpu-sync") as c:
        rt = Runtime(c, {})
        rt.gpu.pinning._api_factory = lambda: fake
        fake.on_sync = lambda dev: c._pending is None      # True: synchronised before begin_token went
        rt.gpu.devices |= {CUDA0, CUDA1}
        rt.gpu.mark(CUDA1)
        rt.gpu.mark(CUDA0)
        rt.begin_forward()
        assert fake.of("synchronize") == [("synchronize", "cuda:0", True), ("synchronize", "cuda:1", True)]
        assert c._pending is not None
        c.settle()
        rt.gpu.mark(CUDA1)                                  # a split model: only cuda:1 worked since
        rt._begin_next()
        assert fake.of("synchronize")[2:] == [("synchronize", "cuda:1", True)]
        c.settle()
    assert d.stop() == 0


def test_a_cpu_model_makes_no_cuda_call(start_daemon):
    pytest.importorskip("transformers", minversion="5")
    from hf_common import checkpoint as hf_checkpoint, daemon_args, prompt

    from k3client.hf import load_model

    path = hf_checkpoint("qwen3_moe")
    d = start_daemon(path, *daemon_args("qwen3_moe"))
    model = load_model(path, endpoint=d.endpoint, dtype=torch.bfloat16)
    try:
        with torch.no_grad():
            model(prompt())
        assert model.k3d.gpu.devices == set() and model.k3d.gpu.pinning._api is None
        assert model.generation_config.disable_compile is True
    finally:
        model.k3d.client.close()
    assert d.stop() == 0


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_the_cuda_layer_loop_equals_eager_bit_for_bit_run_on_cpu(family, start_daemon):
    """``compute.sorted_loop``, the CUDA loop (one sort per layer, no torch.where per expert) run on CPU tensors:
    the order of experts and of each expert's tokens is eager's, so the logits are its bits."""
    pytest.importorskip("transformers", minversion="5")
    from hf_common import checkpoint as hf_checkpoint, daemon_args, eager, prompt

    from k3client.hf import load_model

    path = hf_checkpoint(family)
    d = start_daemon(path, *daemon_args(family))
    ref = eager(path)
    model = load_model(path, endpoint=d.endpoint, dtype=torch.bfloat16)
    rt = model.k3d
    rt._loop = lambda device: compute.sorted_loop
    try:
        with torch.no_grad():
            for seed in range(3):
                ids = prompt(batch=3, length=11, seed=seed)
                assert torch.equal(ref(ids).logits, model(ids).logits), f"seed {seed}"
        assert rt.stats.forwards == 3 and rt.gpu.devices == set()
    finally:
        rt.client.close()
    assert d.stop() == 0
