"""GGUF as llama.cpp ships it: Q4_K_M-style type mixes by layer, legacy per-expert names,
Arctic's ``ffn_norm_exps``, fused ``ffn_gate_up_exps`` — files written by ``gguf.GGUFWriter``
with llama.cpp's tensor names, every served byte checked against ``gguf.GGUFReader``.

K-quants cannot be quantized by ``gguf.quants``: those tensors are random bytes of the
type's exact block size (the bytes are what is served; nothing decodes them here).
The daemon test runs the real ``k3d start`` and reads each layer with its own layout.
"""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T, GGUFReader, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize

import k3client
from k3d.commands.pack import pack_main
from k3d.sources import open_source
from k3d.sources.gguf import GGUFSource

E, H, I = 4, 256, 256       # K-quant rows are whole 256-element blocks


def _raw(rng, qt, shape):
    """Random bytes of a block-quantized tensor of element shape ``shape`` (rows, cols)."""
    block, size = GGML_QUANT_SIZES[qt]
    return rng.integers(0, 256, shape[:-1] + (shape[-1] // block * size,), dtype=np.uint8)


def _write(path, tensors, arch="qwen3moe", experts=E):
    w = GGUFWriter(str(path), arch)
    w.add_block_count(3)
    w.add_expert_count(experts)
    w.add_expert_used_count(2)
    for name, (arr, qt) in tensors.items():
        w.add_tensor(name, arr, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory):
    """3 layers: gate/up Q4_K everywhere, down Q6_K on layers 0 and 2 and Q4_K on layer 1 (llama.cpp's
    Q4_K_M rule), a Q8_0 bias-free router from gguf.quants, and Arctic's ffn_norm_exps [H]."""
    rng = np.random.default_rng(11)
    t = {}
    for layer in range(3):
        t[f"blk.{layer}.ffn_gate_inp.weight"] = (rng.standard_normal((E, H)).astype(np.float32), None)
        t[f"blk.{layer}.ffn_norm_exps.weight"] = (np.ones(H, np.float32), None)
        t[f"blk.{layer}.ffn_gate_exps.weight"] = (_raw(rng, T.Q4_K, (E, I, H)), T.Q4_K)
        t[f"blk.{layer}.ffn_up_exps.weight"] = (_raw(rng, T.Q4_K, (E, I, H)), T.Q4_K)
        down = T.Q4_K if layer == 1 else T.Q6_K
        t[f"blk.{layer}.ffn_down_exps.weight"] = (_raw(rng, down, (E, H, I)), down)
        t[f"blk.{layer}.attn_q.weight"] = (quantize(rng.standard_normal((H, H)).astype(np.float32), T.Q8_0), T.Q8_0)
    return _write(tmp_path_factory.mktemp("gguf") / "q4_k_m.gguf", t, arch="arctic")


def _served(src, key) -> bytes:
    slot = bytearray(src.expert_bytes)
    src.read(src.keys[key], memoryview(slot))
    return bytes(slot)


def test_q4_k_m_mix_every_byte(q4_k_m):
    by_name = {t.name: t for t in GGUFReader(q4_k_m).tensors}
    src = open_source(q4_k_m, None)
    try:
        assert not src.uniform and sorted(src.layouts) == [0, 1, 2]
        assert src.layer_tensor_types[0]["ffn_down_exps.weight"] == "ggml:Q6_K"
        assert src.layer_tensor_types[1]["ffn_down_exps.weight"] == "ggml:Q4_K"
        assert src.tensor_format == ("ggml:ffn_down_exps.weight=Q4_K|Q6_K,ffn_gate_exps.weight=Q4_K,"
                                     "ffn_up_exps.weight=Q4_K")
        # ffn_norm_exps is not stacked over experts: left out; the router and attention too
        assert {s.name for s in src.layout_of(1)} == {"ffn_gate_exps.weight", "ffn_up_exps.weight",
                                                      "ffn_down_exps.weight"}
        big = max(sum(s.nbytes for s in src.layout_of(layer)) for layer in range(3))
        assert src.expert_bytes >= big and src.expert_bytes > sum(s.nbytes for s in src.layout_of(1))
        for layer in range(3):
            for e in range(E):
                slot = _served(src, (layer, e))
                for spec in src.layout_of(layer):
                    ref = np.ascontiguousarray(by_name[f"blk.{layer}.{spec.name}"].data[e])
                    assert slot[spec.offset:spec.offset + spec.nbytes] == ref.tobytes(), (layer, e, spec.name)
    finally:
        src.close()


def test_legacy_per_expert_names(tmp_path):
    """Older Mixtral GGUFs: blk.L.ffn_{gate,up,down}.E.weight, one tensor per expert."""
    rng = np.random.default_rng(5)
    t = {}
    for layer in range(2):
        t[f"blk.{layer}.ffn_gate_inp.weight"] = (rng.standard_normal((E, 64)).astype(np.float32), None)
        for e in range(E):
            for part, shape in (("gate", (32, 64)), ("up", (32, 64)), ("down", (64, 32))):
                x = rng.standard_normal(shape).astype(np.float32)
                t[f"blk.{layer}.ffn_{part}.{e}.weight"] = (quantize(x, T.Q8_0), T.Q8_0)
    p = _write(tmp_path / "legacy.gguf", t, arch="llama")
    by_name = {x.name: x for x in GGUFReader(p).tensors}
    src = GGUFSource(p)
    try:
        assert sorted(src.keys) == [(l, e) for l in range(2) for e in range(E)]
        assert [s.name for s in src.layout] == ["ffn_down.weight", "ffn_gate.weight", "ffn_up.weight"]
        assert src.tensor_format == "ggml:Q8_0"
        for key in src.keys:
            slot = _served(src, key)
            for spec in src.layout:
                part = spec.name.split(".")[0]
                ref = np.ascontiguousarray(by_name[f"blk.{key[0]}.{part}.{key[1]}.weight"].data)
                assert slot[spec.offset:spec.offset + spec.nbytes] == ref.tobytes()
    finally:
        src.close()


def test_fused_gate_up_keeps_working(tmp_path):
    rng = np.random.default_rng(9)
    t = {"blk.0.ffn_gate_up_exps.weight": (quantize(rng.standard_normal((E, 64, 64)).astype(np.float32), T.MXFP4),
                                           T.MXFP4),
         "blk.0.ffn_down_exps.weight": (quantize(rng.standard_normal((E, 64, 32)).astype(np.float32), T.MXFP4),
                                        T.MXFP4)}
    p = _write(tmp_path / "fused.gguf", t, arch="gpt-oss")
    by_name = {x.name: x for x in GGUFReader(p).tensors}
    src = GGUFSource(p)
    try:
        assert {s.name for s in src.layout} == {"ffn_gate_up_exps.weight", "ffn_down_exps.weight"}
        assert src.tensor_format == "ggml:MXFP4"
        for e in range(E):
            slot = _served(src, (0, e))
            for spec in src.layout:
                ref = np.ascontiguousarray(by_name[f"blk.0.{spec.name}"].data[e])
                assert slot[spec.offset:spec.offset + spec.nbytes] == ref.tobytes()
    finally:
        src.close()


def _check_client(c, by_name):
    assert c.layouts and sorted(c.layouts) == [0, 1, 2]
    assert c.layout == c.layout_of(0)
    groups = c.model["layouts"]
    assert sorted(l for g in groups for l in g[0]) == [0, 1, 2]
    down = {layer: next(s for s in c.layout_of(layer) if s.name == "ffn_down_exps.weight") for layer in range(3)}
    assert down[0].shape != down[1].shape          # Q6_K rows are longer than Q4_K rows
    for layer in range(3):
        c.begin_token()
        for ex in c.fetch(layer, [3, 0]):
            for spec in c.layout_of(layer):
                got = ex.array(spec.name)
                assert got.shape == spec.shape
                ref = np.ascontiguousarray(by_name[f"blk.{layer}.{spec.name}"].data[ex.expert])
                assert got.tobytes() == ref.tobytes()
            assert len(ex.memory()) == max(s.offset + s.nbytes for s in c.layout_of(layer))


def test_daemon_serves_each_layer_with_its_layout(q4_k_m, start_daemon, tmp_path):
    by_name = {t.name: t for t in GGUFReader(q4_k_m).tensors}
    d = start_daemon(q4_k_m, "--slots", "4")
    with k3client.connect(d.endpoint, name="mix") as c:
        assert c.model["layers"] == [0, 1, 2] and c.model["kind"] == "gguf"
        _check_client(c, by_name)
    assert d.stop() == 0
    # the same per-layer layouts through a pack of the file (format version 2)
    out = str(tmp_path / "mix.k3pack")
    assert pack_main(q4_k_m, out, None, progress=False) == 0
    d = start_daemon(out, "--slots", "4")
    with k3client.connect(d.endpoint, name="mix-pack") as c:
        assert c.model["kind"] == "packed"
        _check_client(c, by_name)
    assert d.stop() == 0
