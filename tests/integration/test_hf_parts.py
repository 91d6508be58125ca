"""Pure parts of k3client.hf: the fingerprint, the standard-loop check, lazy tensors, the arena address.

Pure, but importing k3client.hf imports torch and transformers (seconds of CPU before
the first test), so they live beside the other hf tests rather than in tests/unit."""

import mmap
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5")

from k3client.hf import families, fingerprint  # noqa: E402
from k3client.hf.checkpoint import Files, LazyTensor  # noqa: E402
from k3client.hf.gpu import address_of  # noqa: E402
from k3client.layout import TensorSpec  # noqa: E402


class FakeClient:        # what fingerprint.check reads from a connected client
    def __init__(self, layout, model):
        self.layout, self.model, self.endpoint = layout, model, "ipc:///x"

    def layout_of(self, layer):
        return self.layout


def _per_expert(layers, experts, shapes):
    return {layer: [(f"model.layers.{layer}.mlp.experts.{e}.{n}", "BF16", s)
                    for e in range(experts) for n, s in shapes.items()] for layer in layers}


def test_fingerprint_accepts_the_same_and_names_the_difference():
    shapes = {"gate_proj.weight": (32, 64), "up_proj.weight": (32, 64), "down_proj.weight": (64, 32)}
    layout = [TensorSpec(n, "BF16", s, 0, 0) for n, s in sorted(shapes.items())]
    model = {"path": "/a", "layers": [0, 2], "experts": [0, 7], "count": 24}
    local = fingerprint.local_layers(_per_expert(range(3), 8, shapes))
    fingerprint.check(FakeClient(layout, model), "/b", local, 8)
    bad = fingerprint.local_layers(_per_expert(range(3), 8, dict(shapes, **{"down_proj.weight": (64, 16)})))
    with pytest.raises(fingerprint.Mismatch, match=r"down_proj.weight BF16 \[64, 16\]"):
        fingerprint.check(FakeClient(layout, model), "/b", bad, 8)
    four = fingerprint.local_layers(_per_expert(range(4), 8, shapes))
    with pytest.raises(fingerprint.Mismatch, match="expert layers 0-3"):
        fingerprint.check(FakeClient(layout, model), "/b", four, 8)


def test_fingerprint_stacked_names_match_by_suffix():
    layout = [TensorSpec("input_linear.weight", "BF16", (64, 32), 0, 0),
              TensorSpec("output_linear.weight", "BF16", (32, 32), 0, 0)]
    keys = {0: [("model.layers.0.block_sparse_moe.input_linear.weight", "BF16", (8, 64, 32)),
                ("model.layers.0.block_sparse_moe.output_linear.weight", "BF16", (8, 32, 32))]}
    model = {"path": "/a", "layers": [0], "experts": [0, 7], "count": 8, "experts_per_layer": 8}
    fingerprint.check(FakeClient(layout, model), "/b", fingerprint.local_layers(keys), 8)


def test_standard_loop_check_tells_gpt_oss_from_mixtral():
    from transformers import AutoConfig, AutoModelForCausalLM

    for mt, want in (("mixtral", True), ("olmoe", True), ("gpt_oss", False)):
        cfg = AutoConfig.for_model(mt, vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts=4)
        with torch.device("meta"):
            m = AutoModelForCausalLM.from_config(cfg)
        mod = next(x for x in m.modules() if hasattr(x, "has_gate"))
        assert families.runs_standard_loop(mod) is want, mt


def test_lazy_tensor_reads_its_own_bytes(tmp_path):
    from safetensors.torch import save_file

    t = {"a": torch.arange(10, dtype=torch.bfloat16), "b": torch.ones(3, 4, dtype=torch.float32)}
    path = str(tmp_path / "x.safetensors")
    save_file(t, path)
    files = Files()
    try:
        header, start = files.header(path)
        for name, want in t.items():
            lt = LazyTensor(files, path, start, header[name])
            assert lt.get_shape() == list(want.shape)
            assert torch.equal(lt[...], want)
    finally:
        files.close()


def test_address_of_a_read_only_mapping(tmp_path):
    p = tmp_path / "m"
    p.write_bytes(b"\x07" * 8192)
    with open(p, "rb") as f:
        mm = mmap.mmap(f.fileno(), 8192, prot=mmap.PROT_READ)
    view = np.frombuffer(mm, dtype=np.uint8)
    assert address_of(mm) == view.ctypes.data
    del view
    mm.close()
    assert os.path.exists(p)
