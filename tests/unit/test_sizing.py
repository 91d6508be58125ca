"""Arena size warnings at start (k3d/service/sizing.py)."""

import json

from k3d.service.sizing import arena_warnings, top_k


def model(path, layers=(0, 1, 2, 3), count=64):   # describe() lists every layer served
    return {"path": str(path), "layers": list(layers), "count": count}


def test_top_k_from_config_json(tmp_path):
    assert top_k(str(tmp_path)) is None
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"num_experts_per_tok": 4}}))
    assert top_k(str(tmp_path)) == 4
    assert top_k(str(tmp_path / "model.safetensors")) == 4


def test_fewer_slots_than_one_token_pins(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_experts_per_tok": 2}))
    w = arena_warnings(7, 2**20, model(tmp_path))
    assert len(w) == 1 and "one token pins 8 (4 layers x top-2)" in w[0] and "--slots 8" in w[0]
    assert arena_warnings(8, 2**20, model(tmp_path)) == []


def test_without_config_at_least_one_per_layer(tmp_path):
    w = arena_warnings(3, 2**20, model(tmp_path))
    assert len(w) == 1 and "top-1 at least" in w[0]


def test_far_more_slots_than_experts(tmp_path):
    w = arena_warnings(100, 2**20, model(tmp_path, count=64))
    assert len(w) == 1 and "only 64 experts" in w[0] and "36MiB will never be used" in w[0]
    assert arena_warnings(80, 2**20, model(tmp_path, count=64)) == []


def test_small_experts_are_sized_in_a_unit_that_shows_them(tmp_path):
    """8 KiB experts: the advice names a size that is enough, in KiB, and parses back."""
    from k3d.sizes import parse_size

    (tmp_path / "config.json").write_text(json.dumps({"num_experts_per_tok": 2}))
    low = arena_warnings(3, 8192, model(tmp_path, count=64))[0]
    assert "raise --arena to at least 64KiB (--slots 8)" in low, low
    high = arena_warnings(100, 8192, model(tmp_path, count=64))[0]
    assert "288KiB will never be used; --slots 64 (--arena 512KiB) holds all of it" in high, high
    assert parse_size("512KiB") // 8192 == 64


def test_remote_source_has_no_local_config():
    assert arena_warnings(4, 2**20, model("https://example.invalid/m/")) == []
