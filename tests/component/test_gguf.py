"""GGUF source: files written by gguf.GGUFWriter, checked against gguf.GGUFReader; bad files refused.

The daemon test runs the real ``k3d start`` on a GGUF file and a real client.
"""

import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T, GGUFReader, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize, quantize

import k3client
from helpers import k3d
from k3client.mxfp4 import dequantize
from k3d.demo.synthetic import write_synthetic_gguf
from k3d.reads.plan import split_extents
from k3d.sources import SourceError, open_source
from k3d.sources.gguf import GGML_TYPES, GGUFSource

PARTS = {"gate": "ffn_gate_exps.weight", "up": "ffn_up_exps.weight", "down": "ffn_down_exps.weight"}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("gguf") / "mixed.gguf")
    return write_synthetic_gguf(p, layers=3, experts=6, types=("MXFP4", "Q8_0", "F16"), bias=True, seed=3)


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("gguf") / "mxfp4.gguf")
    return write_synthetic_gguf(p, layers=2, experts=8, types=("MXFP4",) * 3, seed=4)


def test_type_table_matches_gguf():
    for gid, (name, block, size) in GGML_TYPES.items():
        assert T(gid).name == name
        assert GGML_QUANT_SIZES[T(gid)] == (block, size), name
    for qt, sizes in GGML_QUANT_SIZES.items():
        assert GGML_TYPES[int(qt)][1:] == sizes, qt.name


def test_extents_match_reader(mixed):
    src = GGUFSource(mixed)
    reader = GGUFReader(mixed)
    try:
        by_name = {t.name: t for t in reader.tensors}
        assert len(src.keys) == 3 * 6
        assert [s.name for s in src.layout] == ["ffn_down_exps.weight", "ffn_gate_exps.bias",
                                                "ffn_gate_exps.weight", "ffn_up_exps.weight"]
        spec = {s.name: s for s in src.layout}
        assert spec["ffn_down_exps.weight"].dtype == "F16" and spec["ffn_down_exps.weight"].shape == (256, 128)
        assert spec["ffn_gate_exps.weight"].dtype == "U8"
        assert spec["ffn_gate_exps.weight"].shape == (128, 256 // 32 * 17)
        assert spec["ffn_up_exps.weight"].shape == (128, 256 // 32 * 34)
        assert src.tensor_types == {"ffn_down_exps.weight": "ggml:F16", "ffn_gate_exps.bias": "ggml:F32",
                                    "ffn_gate_exps.weight": "ggml:MXFP4", "ffn_up_exps.weight": "ggml:Q8_0"}
        assert src.tensor_format.startswith("ggml:") and "ffn_up_exps.weight=Q8_0" in src.tensor_format
        slot = bytearray(src.expert_bytes)
        for key in [(0, 0), (1, 5), (2, 3)]:
            # read in parts, as the server does, to cover split extents
            for part in split_extents(src.keys[key], 3):
                src.read(part, memoryview(slot))
            for s in src.layout:
                ref = by_name[f"blk.{key[0]}.{s.name}"]
                assert ref.data.shape[0] == 6
                got = np.frombuffer(slot, np.uint8, s.nbytes, s.offset)
                assert got.tobytes() == np.ascontiguousarray(ref.data[key[1]]).tobytes(), (key, s.name)
    finally:
        src.close()


def test_uniform_type_format(mxfp4, tmp_path):
    src = open_source(mxfp4, "unused")
    assert src.kind == "gguf" and src.tensor_format == "ggml:MXFP4"
    assert src.describe()["tensor_types"]["ffn_up_exps.weight"] == "ggml:MXFP4"
    src.close()
    q8 = write_synthetic_gguf(str(tmp_path / "q8.gguf"), layers=1, experts=2, types=("Q8_0",) * 3)
    src = open_source(q8, "unused")
    assert src.tensor_format == "ggml:Q8_0"
    src.close()


def test_daemon_serves_gguf(mxfp4, start_daemon):
    d = start_daemon(mxfp4, "--arena", "8MiB")
    reader = GGUFReader(mxfp4)
    by_name = {t.name: t for t in reader.tensors}
    with k3client.connect(d.endpoint, name="gguf-test") as c:
        assert c.model["kind"] == "gguf" and c.model["tensor_format"] == "ggml:MXFP4"
        assert c.model["tensor_types"]["ffn_down_exps.weight"] == "ggml:MXFP4"
        assert {s.name for s in c.layout} == set(PARTS.values())
        for layer in range(2):
            c.begin_token()
            experts = c.fetch(layer, [7, 0, 3])
            for ex in experts:
                for name in PARTS.values():
                    ref = np.ascontiguousarray(by_name[f"blk.{layer}.{name}"].data[ex.expert])
                    got = ex.array(name)
                    assert got.tobytes() == ref.tobytes()
                    # the served bytes decode as gguf decodes the file, bit for bit
                    assert np.array_equal(dequantize(got, layout="ggml").view(np.uint32),
                                          gguf_dequantize(ref, T.MXFP4).view(np.uint32))
    assert d.stop() == 0


# -- bad files ---------------------------------------------------------------------------
def _write(path, tensors, kv=None):
    w = GGUFWriter(str(path), "qwen3moe")
    for k, v in (kv or {}).items():
        w.add_uint32(k, v)
    for name, (arr, raw) in tensors.items():
        w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _q8(shape, seed=0):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return quantize(x, T.Q8_0), T.Q8_0


def _info_pos(path, name):
    """Offset of the u32 ggml type field in the tensor info of ``name``."""
    raw = open(path, "rb").read()
    enc = name.encode()
    i = raw.index(struct.pack("<Q", len(enc)) + enc) + 8 + len(enc)
    nd = struct.unpack_from("<I", raw, i)[0]
    return i + 4 + 8 * nd


def _patch(path, pos, data):
    with open(path, "r+b") as f:
        f.seek(pos)
        f.write(data)


def test_truncated_file(mxfp4, tmp_path):
    p = tmp_path / "cut.gguf"
    raw = open(mxfp4, "rb").read()
    p.write_bytes(raw[:-100])
    with pytest.raises(SourceError, match=r"truncated: tensor 'blk\.1\.ffn_\w+_exps\.weight' needs bytes"):
        GGUFSource(str(p))
    p.write_bytes(raw[:200])
    with pytest.raises(SourceError, match="truncated GGUF header"):
        GGUFSource(str(p))


def test_no_expert_tensors(tmp_path):
    p = _write(tmp_path / "dense.gguf", {"blk.0.ffn_gate.weight": _q8((64, 64))})
    with pytest.raises(SourceError, match=r"no expert tensors \(blk\.N\.ffn_\*_exps\.\* or "
                                          r"blk\.N\.ffn_gate\.E\.weight\)"):
        GGUFSource(p)


def test_two_names_for_one_layer(tmp_path):
    """blk.1 and blk.01 are both layer 1: refused, not one of them silently served."""
    p = _write(tmp_path / "t.gguf", {"blk.1.ffn_up_exps.weight": _q8((2, 8, 64)),
                                     "blk.01.ffn_up_exps.weight": _q8((2, 8, 64), 1)})
    with pytest.raises(SourceError, match=r"tensors 'blk\.0?1\.ffn_up_exps\.weight' and 'blk\.0?1\.ffn_up_exps"
                                          r"\.weight' are both layer 1's 'ffn_up_exps\.weight'; remove one"):
        GGUFSource(p)


def test_unknown_ggml_type(tmp_path):
    p = _write(tmp_path / "t.gguf", {"blk.0.ffn_up_exps.weight": _q8((2, 8, 64))})
    _patch(p, _info_pos(p, "blk.0.ffn_up_exps.weight"), struct.pack("<I", 77))
    with pytest.raises(SourceError, match=r"tensor 'blk\.0\.ffn_up_exps\.weight' has unknown GGML type 77"):
        GGUFSource(p)


def test_offset_that_lies(tmp_path):
    t = {"blk.0.ffn_up_exps.weight": _q8((2, 8, 64)), "blk.0.ffn_down_exps.weight": _q8((2, 64, 64), 1)}
    p = _write(tmp_path / "t.gguf", t)
    pos = _info_pos(p, "blk.0.ffn_down_exps.weight") + 4
    _patch(p, pos, struct.pack("<Q", 0))       # now overlaps the first tensor
    with pytest.raises(SourceError, match="overlaps tensor"):
        GGUFSource(p)
    _patch(p, pos, struct.pack("<Q", 1 << 40))
    with pytest.raises(SourceError, match=r"truncated: tensor 'blk\.0\.ffn_down_exps\.weight'"):
        GGUFSource(p)
    _patch(p, pos, struct.pack("<Q", 33))
    with pytest.raises(SourceError, match="not a multiple of the alignment"):
        GGUFSource(p)


def test_layers_with_other_types_and_shapes_get_their_own_layout(tmp_path):
    """Layers may differ (a Q4_K_M mix, a missing bias): each layer is served with its own layout."""
    t = {"blk.0.ffn_up_exps.weight": _q8((4, 8, 64)), "blk.0.ffn_gate_exps.weight": _q8((4, 8, 64)),
         "blk.1.ffn_up_exps.weight": (np.ones((4, 16, 64), np.float16), None)}
    p = _write(tmp_path / "t.gguf", t)
    src = GGUFSource(p)
    try:
        assert not src.uniform
        assert [(s.name, s.dtype, s.shape) for s in src.layout_of(0)] == [
            ("ffn_gate_exps.weight", "U8", (8, 68)), ("ffn_up_exps.weight", "U8", (8, 68))]
        assert [(s.name, s.dtype, s.shape) for s in src.layout_of(1)] == [("ffn_up_exps.weight", "F16", (16, 64))]
        assert src.layer_tensor_types == {0: {"ffn_gate_exps.weight": "ggml:Q8_0", "ffn_up_exps.weight": "ggml:Q8_0"},
                                          1: {"ffn_up_exps.weight": "ggml:F16"}}
        assert src.tensor_format == "ggml:ffn_gate_exps.weight=Q8_0,ffn_up_exps.weight=F16|Q8_0"
        assert src.expert_bytes == 16 * 64 * 2
    finally:
        src.close()


def test_expert_counts_disagree(tmp_path):
    t = {"blk.0.ffn_up_exps.weight": _q8((4, 8, 64)), "blk.0.ffn_down_exps.weight": _q8((3, 8, 64))}
    p = _write(tmp_path / "t.gguf", t)
    with pytest.raises(SourceError, match="disagree on the expert count"):
        GGUFSource(p)
    p = _write(tmp_path / "t2.gguf", {"blk.0.ffn_up_exps.weight": _q8((4, 8, 64))}, kv={"qwen3moe.expert_count": 5})
    with pytest.raises(SourceError, match="qwen3moe.expert_count says 5 but the expert tensors stack 4"):
        GGUFSource(p)


def test_not_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(SourceError, match="not a GGUF file"):
        open_source(str(p), "unused")


def test_start_refuses_bad_gguf_in_one_line(tmp_path):
    p = _write(tmp_path / "dense.gguf", {"blk.0.attn_q.weight": _q8((64, 64))})
    r = k3d("start", "--source", p, "--endpoint", f"ipc://{tmp_path}/k.sock")
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no expert tensors" in lines[0], r.stderr
