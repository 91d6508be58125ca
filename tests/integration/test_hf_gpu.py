"""GPU hosts only (skipped without CUDA): registration, device bytes, bit-equal logits, bandwidth.

Written to run as one short script on a lent GPU machine:
``python -m pytest -q tests/integration/test_hf_gpu.py tests/integration/test_vllm_gpu.py``.
The same registration code runs here against a stand-in of the CUDA calls
(tests/unit/test_gpu_pinning.py, tests/integration/test_gpu_arena.py).
"""

import json
import os
import subprocess
import sys
import tempfile
import threading
import warnings

import pytest
from hf_common import checkpoint, daemon_args, eager, prompt, torch

from conftest import SCRATCH
from helpers import expert_bytes, reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this host)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def device_images(c, exs, g, device):
    """Every fetched expert's tensors copied to ``device`` as the runtime copies them (the copy
    stream, from the registered arena), then laid out as a slot image, on the device."""
    out = {}
    group = [(ex.expert, {s.name: ex.tensor(s.name) for s in c.layout_of(ex.layer)}) for ex in exs]
    for (e, dv), ex in zip(g.copier.stage(group, device), exs):
        img = torch.zeros(c.expert_bytes, dtype=torch.uint8, device=device)
        for s in c.layout_of(ex.layer):
            img[s.offset:s.offset + s.nbytes] = dv[s.name].reshape(-1).view(torch.uint8)
        out[(ex.layer, e)] = img
    torch.cuda.synchronize()
    return out


def test_device_bytes_equal_the_checkpoint_across_a_restart_onto_another_checkpoint(tmp_path, start_daemon):
    import k3client
    from k3client.hf.gpu import GpuSide
    from k3d.demo.synthetic import write_checkpoint

    a = write_checkpoint(str(tmp_path / "a"), layers=2, experts=8, seed=11)
    b = write_checkpoint(str(tmp_path / "b"), layers=2, experts=8, seed=12)     # same shapes, other bytes
    ep = f"ipc://{tempfile.mkdtemp(prefix='k3d-gpu-', dir=SCRATCH)}/k.sock"
    dev = torch.device("cuda", torch.cuda.current_device())
    d = start_daemon(a, "--slots", "16", endpoint=ep)
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # a failed registration warns: none may
        c = k3client.connect(ep, name="gpu-bytes", reconnect_timeout=30)
        try:
            g = GpuSide(c)
            g.use(c, [dev])
            assert g.pinning.is_registered(c.arena, c.gen)
            for ckpt, label in ((a, "A"), (b, "B")):
                ref = reference(ckpt)
                for layer in range(2):
                    exs = c.fetch(layer, list(range(8)))
                    assert exs[0].tensor(c.layout[0].name).is_pinned()
                    for key, img in device_images(c, exs, g, dev).items():
                        want = torch.frombuffer(bytearray(expert_bytes(ref, c.layout, key)), dtype=torch.uint8)
                        assert torch.equal(img[:len(want)], want.to(dev)), f"daemon {label}: wrong device bytes {key}"
                    c.begin_token()
                if label == "A":
                    old = (id(c.arena), c.gen)
                    assert d.stop() == 0
                    d = start_daemon(b, "--slots", "16", endpoint=ep)
                    c.fetch(0, [0])                  # re-attach: the old mapping unregistered, then unmapped
                    assert c.restarts == 1 and old not in g.pinning.registered
                    g.follow(c)                      # what the runtime's restart check does
                    assert list(g.pinning.registered) == [(id(c.arena), c.gen)]
                    c.begin_token()
        finally:
            c.close()
    assert g.pinning.registered == {}
    assert d.stop() == 0


def test_a_failed_registration_leaves_no_pending_error_and_names_it():
    """Two registrations of one range: the driver refuses the second (712); the warning names it
    and the next, unrelated kernel launch does not raise it."""
    import mmap

    from k3client.gpu.pinning import Pinning

    dev = torch.device("cuda", torch.cuda.current_device())
    fd = os.memfd_create("k3d-test-arena")          # shared, read-only: as an arena is mapped
    os.ftruncate(fd, 16 << 20)
    mm = mmap.mmap(fd, 16 << 20, prot=mmap.PROT_READ)
    os.close(fd)
    first, second = Pinning(_api), Pinning(_api)
    try:
        assert first.register(mm, 1, 1 << 20, {dev})
        with pytest.warns(RuntimeWarning, match="cudaErrorHostMemoryAlreadyRegistered .712: "):
            assert not second.register(mm, 1, 1 << 20, {dev})
        x = torch.ones(4, device=dev)
        x.add_(1)                                     # raised the pending error before issue 36
        torch.cuda.synchronize()
        assert x.sum().item() == 8
    finally:
        first.release(mm, torch.cuda.synchronize)
        mm.close()


def _api():
    from k3client.gpu.cuda import CudaApi

    return CudaApi()


def _models(path, endpoint):
    from k3client.hf import load_model

    ref = eager(path).to("cuda")
    # moved after loading (device_map="cuda" would register at load; it needs accelerate)
    model = load_model(path, endpoint=endpoint, dtype=torch.bfloat16).to("cuda")
    return ref, model


def test_logits_bit_equal_to_eager_on_cuda_with_the_arena_registered(start_daemon):
    path = checkpoint("qwen3_moe")
    d = start_daemon(path, *daemon_args("qwen3_moe"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        ref, model = _models(path, d.endpoint)
        try:
            rt = model.k3d
            assert rt.gpu.devices == set()          # loaded on the CPU: nothing registered yet
            ids = prompt().to("cuda")
            with torch.no_grad():
                for _ in range(3):
                    assert torch.equal(ref(ids).logits, model(ids).logits)
            assert rt.gpu.devices == {torch.device("cuda", torch.cuda.current_device())}
            assert rt.gpu.pinning.is_registered(rt.client.arena, rt.client.gen)
            ml = next(iter(rt.layers.values()))
            assert rt.client.fetch(ml.layer, [0])[0].tensor(ml.names[0]).is_pinned()
            g_ref = ref.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
            assert torch.equal(g_ref, model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0))
            # transformers would compile a static-cache generate on CUDA; k3d's model runs it eagerly
            g_static = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0,
                                      cache_implementation="static")
            assert torch.equal(g_static, ref.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0,
                                                      cache_implementation="static", disable_compile=True))
            assert len(rt.gpu.pinning.registered) == 1
        finally:
            model.k3d.client.close()
    assert model.k3d.gpu.pinning.registered == {}
    assert d.stop() == 0


def test_logits_bit_equal_while_a_second_client_evicts(start_daemon):
    import k3client

    path = checkpoint("qwen3_moe")
    d = start_daemon(path, "--slots", "12")          # fewer slots than a forward's experts
    ref, model = _models(path, d.endpoint)
    stop, errors = threading.Event(), []

    def evict():
        try:
            with k3client.connect(d.endpoint, name="evictor") as c:
                n, layers = 0, sorted(model.k3d.layers)
                while not stop.is_set():
                    c.begin_token()
                    c.fetch(layers[n % len(layers)], [(n * 5 + i) % 8 for i in range(3)])
                    n += 1
        except BaseException as e:  # reported below
            errors.append(e)

    t = threading.Thread(target=evict, daemon=True)
    t.start()
    try:
        with torch.no_grad():
            for seed in range(6):
                ids = prompt(batch=3, length=9, seed=seed).to("cuda")
                assert torch.equal(ref(ids).logits, model(ids).logits), f"seed {seed}"
        assert model.k3d.stats.epochs > model.k3d.stats.forwards, "no mid-forward epoch: not a test of the sync"
    finally:
        stop.set()
        t.join(10)
        model.k3d.client.close()
    assert not errors, errors
    assert d.stop() == 0


def test_registered_arena_copies_at_pinned_speed_and_pins_each_byte_once():
    """bench/gpu.py's bandwidth and host-memory figures, against their targets."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu.py"), "--phases", "bandwidth",
                        "--reps", "5"], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    fig = json.loads(r.stdout.strip().splitlines()[-1])
    bw = fig["bandwidth"]
    assert bw["registered_vs_pinned"] >= 0.8, bw
    assert bw["host_bytes_per_arena_byte"] <= 1.05, bw
