"""The content digest's rule (``k3client.digest``): where it samples, what changes it, how a difference reads."""

from __future__ import annotations

import hashlib

from hypothesis import given, strategies as st

from k3client.digest import (
    BLOCK,
    BLOCKS,
    RULE,
    assemble,
    first_difference,
    sample_ranges,
    sampled_bytes,
    tensor_hash,
)


@given(st.integers(min_value=0, max_value=1 << 44))
def test_samples_are_bounded_inside_the_tensor_first_and_last_block_included(nbytes):
    rs = sample_ranges(nbytes)
    assert sampled_bytes(nbytes) <= BLOCK * BLOCKS
    if nbytes <= BLOCK * BLOCKS:
        assert rs == ([(0, nbytes)] if nbytes else [])
        return
    assert len(rs) == BLOCKS and all(n == BLOCK for _, n in rs)
    assert rs[0][0] == 0 and rs[-1][0] + BLOCK == nbytes
    starts = [s for s, _ in rs]
    assert starts == sorted(starts) and all(0 <= s <= nbytes - BLOCK for s in starts)


def _sampled(data: bytes) -> bytes:
    return tensor_hash(len(data), [data[s:s + n] for s, n in sample_ranges(len(data))])


def test_a_byte_in_a_sampled_block_changes_the_hash_one_between_blocks_does_not():
    data = bytearray(hashlib.shake_256(b"x").digest(1 << 20))
    h = _sampled(bytes(data))
    starts = [s for s, _ in sample_ranges(len(data))]
    for pos in (0, starts[3] + 17, len(data) - 1):
        other = bytearray(data)
        other[pos] ^= 1
        assert _sampled(bytes(other)) != h, pos
    gap = starts[1] - 1                        # between the first and the second block: the stated limit
    other = bytearray(data)
    other[gap] ^= 1
    assert _sampled(bytes(other)) == h


def test_small_tensors_are_hashed_whole():
    data = bytearray(range(256)) * 16
    other = bytearray(data)
    other[len(data) // 2] ^= 0x80
    assert _sampled(bytes(data)) != _sampled(bytes(other))


def _digest(**changes):
    layer = [("down", "BF16", (4, 8)), ("up", "BF16", (8, 4))]
    specs = {0: list(layer), 1: list(layer)}
    hashes = {(l, e): {n: tensor_hash(64, [bytes([l, e, len(n)]) * 8]) for n in ("down", "up")}
              for l in (0, 1) for e in range(4)}
    if "bytes" in changes:
        hashes[(1, 2)]["up"] = tensor_hash(64, [b"fine-tune"])
    if "dtype" in changes:
        specs[0] = [("down", "F16", (4, 8)), ("up", "BF16", (8, 4))]
    if "expert" in changes:
        del hashes[(0, 3)]
    if "names" in changes:
        specs[1] = [("w1", "BF16", (4, 8)), ("w2", "BF16", (8, 4))]
        for e in range(4):
            hashes[(1, e)] = {"w1": b"1" * 16, "w2": b"2" * 16}
    if "layers" in changes:
        del specs[1]
        hashes = {k: v for k, v in hashes.items() if k[0] == 0}
    return assemble(specs, dict(reversed(list(hashes.items()))) if "reorder" in changes else hashes)


def test_digest_is_one_value_of_layout_and_bytes_whatever_the_order_they_came_in():
    base = _digest()
    assert base["rule"] == RULE and len(base["hex"]) == 32 and len(base["parts"]) == 4
    assert _digest(reorder=True) == base
    assert first_difference(base, _digest()) is None
    for change in ("bytes", "dtype", "expert", "names", "layers"):
        assert _digest(**{change: True})["hex"] != base["hex"], change


def test_first_difference_names_the_layer_and_tensor_in_one_line():
    base = _digest()
    said = {c: first_difference(base, _digest(**{c: True})) for c in ("bytes", "dtype", "expert", "names", "layers")}
    assert said["bytes"].startswith("layer 1 tensor up holds other bytes")
    assert said["dtype"] == "layer 0 tensor down is BF16 [4, 8] served, F16 [4, 8] locally"
    assert said["expert"] == "layer 0 tensor down: 4 experts per layer served, 3 per layer locally"
    assert said["names"] == "layer 1 has expert tensors [down, up] served, [w1, w2] locally"
    assert said["layers"] == "expert layers 0-1 served, 0 locally"
    assert all("\n" not in s for s in said.values())
    assert "rule" in first_difference({**base, "rule": "k3d-digest/0"}, base)
