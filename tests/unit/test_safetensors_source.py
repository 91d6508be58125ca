"""Unit: hand-parsed safetensors headers match the reference reader; bad files are refused."""

import json
import os
import struct

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from k3d.config import DEFAULT_PATTERN
from k3d.reads.plan import split_extents
from k3d.sources import Extent, SourceError
from k3d.sources.safetensors import SafetensorsSource

P = "model.layers.{l}.mlp.experts.{e}.{n}"


def test_extents_match_reference(checkpoint):
    src = SafetensorsSource(checkpoint, DEFAULT_PATTERN)
    try:
        assert len(src.keys) == 64
        names = [s.name for s in src.layout]
        assert names == sorted(names) and "w1.weight_packed" in names
        assert src.tensor_format == "ocp:MXFP4"
        with open(os.path.join(checkpoint, "model.safetensors.index.json")) as f:
            wm = json.load(f)["weight_map"]
        slot = bytearray(src.expert_bytes)
        for key in [(0, 0), (2, 7), (3, 15)]:
            src.read(src.keys[key], memoryview(slot))
            for spec in src.layout:
                name = P.format(l=key[0], e=key[1], n=spec.name)
                with safe_open(os.path.join(checkpoint, wm[name]), "np") as f:
                    ref = f.get_tensor(name)
                got = np.frombuffer(slot, np.uint8, spec.nbytes, spec.offset)
                assert got.tobytes() == ref.tobytes()
    finally:
        src.close()


def _write(tmp_path, tensors):
    p = tmp_path / "model.safetensors"
    save_file(tensors, str(p))
    return p


def test_expert_with_other_shape_is_named(tmp_path):
    t = {P.format(l=0, e=0, n="w"): np.zeros((4, 4), np.uint8), P.format(l=0, e=1, n="w"): np.zeros((4, 2), np.uint8)}
    _write(tmp_path, t)
    with pytest.raises(SourceError, match=r"\(layer 0, expert 1\) tensor 'w' is U8\[4, 2\]"):
        SafetensorsSource(str(tmp_path), DEFAULT_PATTERN)


def test_expert_missing_tensor_is_named(tmp_path):
    """Within a layer every expert has its layer's tensors (layers may differ: see the next test)."""
    t = {P.format(l=1, e=0, n="a"): np.zeros(4, np.uint8), P.format(l=1, e=0, n="b"): np.zeros(4, np.uint8),
         P.format(l=1, e=3, n="a"): np.zeros(4, np.uint8)}
    _write(tmp_path, t)
    with pytest.raises(SourceError, match=r"\(layer 1, expert 3\) lacks tensor 'b' that expert \(1, 0\) has"):
        SafetensorsSource(str(tmp_path), DEFAULT_PATTERN)


def test_layers_may_differ(tmp_path):
    """A mixed checkpoint: each layer its own layout, slots sized to the largest expert."""
    t = {}
    for e in range(2):
        t[P.format(l=0, e=e, n="a")] = np.full(4, e, np.uint8)
        t[P.format(l=0, e=e, n="b")] = np.full(8, e, np.uint8)
        t[P.format(l=1, e=e, n="a")] = np.full(100, 10 + e, np.float16)
    _write(tmp_path, t)
    src = SafetensorsSource(str(tmp_path), DEFAULT_PATTERN)
    try:
        assert not src.uniform and src.layout == src.layout_of(0)
        assert [s.name for s in src.layout_of(0)] == ["a", "b"]
        assert [(s.name, s.dtype, s.shape) for s in src.layout_of(1)] == [("a", "F16", (100,))]
        assert src.expert_bytes == 200
        groups = src.describe()["layouts"]
        assert [g[0] for g in groups] == [[0], [1]]
        slot = _slot(src, (1, 1))
        assert np.frombuffer(slot[:200], np.float16).tolist() == [11.0] * 100
    finally:
        src.close()


def test_no_matching_tensor(tmp_path):
    _write(tmp_path, {"lm_head.weight": np.zeros(4, np.float32)})
    with pytest.raises(SourceError, match="no tensor matches"):
        SafetensorsSource(str(tmp_path), DEFAULT_PATTERN)


def _raw(tmp_path, header: dict, data: bytes, n_override=None):
    h = json.dumps(header).encode()
    p = tmp_path / "model.safetensors"
    p.write_bytes(struct.pack("<Q", n_override if n_override is not None else len(h)) + h + data)
    return str(tmp_path)


@pytest.mark.parametrize("header,data,n,match", [
    ({"x": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}}, b"\0" * 4, None, "out of bounds"),
    ({"x": {"dtype": "U8", "shape": [8], "data_offsets": [0, 4]}}, b"\0" * 4, None, "needs 8"),
    ({"x": {"dtype": "Q9", "shape": [4], "data_offsets": [0, 4]}}, b"\0" * 4, None, "unknown dtype"),
    ({"x": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}, b"\0" * 8, None, "data area is 8"),
    ({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
      "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}, b"\0" * 6, None, "hole or overlap"),
    ({"x": {"dtype": ["U8"], "shape": [4], "data_offsets": [0, 4]}}, b"\0" * 4, None, "unknown dtype"),
    ({"x": {"dtype": "U8", "shape": 4, "data_offsets": [0, 4]}}, b"\0" * 4, None, "malformed shape"),
    ({}, b"", 10**9, "not a safetensors file .*over the 100000000-byte limit"),
    ({}, b"", 5000, "past the end"),
])
def test_lying_headers_are_refused(tmp_path, header, data, n, match):
    with pytest.raises(SourceError, match=match):
        SafetensorsSource(_raw(tmp_path, header, data, n), DEFAULT_PATTERN)


@pytest.mark.parametrize("content", [
    np.random.default_rng(35).integers(0, 256, 4096, dtype=np.uint8).tobytes(),   # random bytes
    b"\x10" + bytes(7) + b"PK\x03\x04 a zip, not JSON",                           # a size, then no JSON
], ids=["random bytes", "a size then no JSON"])
def test_another_kind_of_file_is_not_a_safetensors_file(tmp_path, content):
    (tmp_path / "model.safetensors").write_bytes(content)
    with pytest.raises(SourceError) as e:
        SafetensorsSource(str(tmp_path), DEFAULT_PATTERN)
    assert str(e.value).startswith(f"{tmp_path / 'model.safetensors'}: not a safetensors file (")
    assert "\n" not in str(e.value)


def test_truncated_file(tmp_path):
    p = tmp_path / "model.safetensors"
    p.write_bytes(b"\x01\x02")
    with pytest.raises(SourceError, match="too short"):
        SafetensorsSource(str(tmp_path), DEFAULT_PATTERN)


def test_pattern_needs_all_fields(tmp_path):
    with pytest.raises(SourceError, match=r"\{expert\}"):
        SafetensorsSource(str(tmp_path), "layers.{layer}.{name}")


def test_split_extents_never_makes_more_parts_than_asked():
    for pages, tail in [(8, 7), (7, 4095), (3228, 0), (1, 1)]:
        total = pages * 4096 + tail
        for parts in range(1, 10):
            groups = split_extents([Extent(0, 0, 0, total)], parts)
            assert len(groups) <= parts and sum(e.length for g in groups for e in g) == total
            assert all(e.offset % 4096 == 0 for g in groups for e in g)


def test_split_extents_covers_every_byte_once():
    ext = [Extent(0, 1000, 0, 10000), Extent(0, 11000, 10048, 5000), Extent(1, 0, 15104, 3000)]
    for parts in (1, 2, 3, 8):
        groups = split_extents(ext, parts)
        assert 1 <= len(groups) <= parts
        cover = sorted((e.slot_offset, e.slot_offset + e.length, e.offset - e.slot_offset, e.file)
                       for g in groups for e in g)
        total = sum(b - a for a, b, _, _ in cover)
        assert total == 18000
        for (_, b0, _, _), (a1, _, _, _) in zip(cover, cover[1:]):
            assert b0 <= a1


def test_plain_tensors_are_raw(tmp_path):
    _write(tmp_path, {P.format(l=0, e=0, n="w1.weight"): np.zeros((4, 4), np.float16)})
    src = SafetensorsSource(str(tmp_path), DEFAULT_PATTERN)
    assert src.tensor_format == "raw"
    src.close()


@pytest.mark.parametrize("shard", [3, "../model.safetensors", ""])
def test_index_with_bad_shard_names(tmp_path, shard):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": shard}}))
    with pytest.raises(SourceError, match="not a usable safetensors index"):
        SafetensorsSource(str(tmp_path), DEFAULT_PATTERN)


def _slot(src, key) -> bytes:
    slot = bytearray(src.expert_bytes)
    src.read(src.keys[key], memoryview(slot))
    return bytes(slot)


def test_index_names_the_shard_a_tensor_is_read_from(tmp_path):
    """A stale copy of a tensor in another shard is ignored: the index's weight_map decides."""
    w = P.format(l=0, e=0, n="w")
    save_file({w: np.full(8, 1, np.uint8)}, str(tmp_path / "a.safetensors"))
    save_file({w: np.full(8, 0xEE, np.uint8), P.format(l=0, e=1, n="w"): np.full(8, 2, np.uint8)},
              str(tmp_path / "b.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {w: "a.safetensors", P.format(l=0, e=1, n="w"): "b.safetensors"}}))
    src = SafetensorsSource(str(tmp_path), DEFAULT_PATTERN)
    try:
        assert _slot(src, (0, 0)) == bytes([1] * 8) and _slot(src, (0, 1)) == bytes([2] * 8)
    finally:
        src.close()
    # the index puts a tensor in a shard that lacks it
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {w: "a.safetensors", P.format(l=0, e=1, n="w"): "a.safetensors"}}))
    with pytest.raises(SourceError, match=r"puts tensor '.*experts\.1\.w' in a.safetensors, which does not hold it"):
        SafetensorsSource(str(tmp_path), DEFAULT_PATTERN)


def test_a_tensor_in_two_shards_without_an_index_is_refused(tmp_path):
    w = P.format(l=0, e=0, n="w")
    save_file({w: np.full(8, 1, np.uint8)}, str(tmp_path / "a.safetensors"))
    save_file({w: np.full(8, 0xEE, np.uint8)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(SourceError, match=r"\(a.safetensors\) and .* \(b.safetensors\) are both tensor 'w' "
                                          r"of expert \(layer 0, expert 0\); remove one or name one in"):
        SafetensorsSource(str(tmp_path), DEFAULT_PATTERN)


def test_two_names_for_one_expert_are_refused(tmp_path):
    _write(tmp_path, {P.format(l=1, e=0, n="w"): np.full(8, 1, np.uint8),
                      P.format(l="01", e=0, n="w"): np.full(8, 7, np.uint8)})
    with pytest.raises(SourceError, match=r"layers\.(1|01)\..* and .*layers\.(01|1)\..* are both tensor 'w' "
                                          r"of expert \(layer 1, expert 0\)"):
        SafetensorsSource(str(tmp_path), DEFAULT_PATTERN)


def test_empty_tensor_in_the_layout(tmp_path):
    """A legal zero-element tensor: nothing to read for it, every other byte served."""
    t = {}
    for e in range(2):
        t[P.format(l=0, e=e, n="bias")] = np.zeros((0,), np.float32)
        t[P.format(l=0, e=e, n="w")] = np.full(16, e + 1, np.uint8)
    _write(tmp_path, t)
    src = SafetensorsSource(str(tmp_path), DEFAULT_PATTERN)
    try:
        spec = next(s for s in src.layout if s.name == "w")
        for e in range(2):
            assert _slot(src, (0, e))[spec.offset:spec.offset + 16] == bytes([e + 1] * 16)
    finally:
        src.close()


def test_unreadable_shard_is_one_line(tmp_path):
    (tmp_path / "x.safetensors").mkdir()
    with pytest.raises(SourceError, match=r"x.safetensors: cannot read \(Is a directory\)"):
        SafetensorsSource(str(tmp_path), DEFAULT_PATTERN)
