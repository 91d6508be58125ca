"""MXFP4 dequantization: OCP against a hand-written reference, GGML against gguf.quants, bit for bit.

numpy inputs; the same checks with torch tensors, and gpt-oss against transformers' own
dequantizer (optional extras whose import alone costs seconds), are
tests/integration/test_mxfp4_torch.py."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize

from k3client.mxfp4 import dequantize
from mxfp4_reference import bits, ocp_reference, random_ocp


@pytest.mark.parametrize("shape", [(3, 64), (2, 3, 32), (1, 16)])
def test_ocp_matches_hand_reference(shape):
    packed, scales = random_ocp(shape)
    ref = ocp_reference(packed, scales)
    got = dequantize(packed, scales, layout="ocp")
    assert got.dtype == np.float32 and got.shape == ref.shape
    assert np.array_equal(bits(got), bits(ref))     # includes -0.0 for nibble 0b1000


def test_ocp_every_nibble_and_scale():
    nibbles = np.arange(16, dtype=np.uint8)
    packed = np.tile(nibbles[0::2] | (nibbles[1::2] << 4), (256, 2))      # [256, 16]: 32 elements
    scales = np.arange(256, dtype=np.uint8)[:255, None]
    ref = ocp_reference(packed[:255], scales)
    assert np.array_equal(bits(dequantize(packed[:255], scales)), bits(ref))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # gguf's own inf at scale 254
def test_ggml_matches_gguf_bit_for_bit():
    rng = np.random.default_rng(5)
    blocks = rng.integers(0, 256, (4, 7, 255 // 7 + 1, 17), dtype=np.uint8)
    blocks[..., 0] = (np.arange(blocks[..., 0].size) % 255).reshape(blocks.shape[:-1])   # every scale 0..254
    data = blocks.reshape(4, 7, -1)
    ref = gguf_dequantize(data, T.MXFP4)
    got = dequantize(data, layout="ggml")
    assert got.shape == ref.shape and np.array_equal(bits(got), bits(ref))


def test_ggml_from_gguf_quantizer():
    x = np.random.default_rng(6).standard_normal((16, 256)).astype(np.float32)
    q = gguf_quantize(x, T.MXFP4)
    assert q.shape == (16, 256 // 32 * 17)
    assert np.array_equal(bits(dequantize(q, layout="ggml")), bits(gguf_dequantize(q, T.MXFP4)))


def test_layouts_differ_only_in_byte_order():
    """The same values in both layouts decode the same (up to the sign of zero)."""
    rng = np.random.default_rng(7)
    packed = rng.integers(0, 256, (5, 32), dtype=np.uint8)              # OCP: 64 elements per row
    scales = rng.integers(110, 140, (5, 2), dtype=np.uint8)
    nib = np.stack([packed & 0xF, packed >> 4], -1).reshape(5, 2, 32)  # element order
    qs = nib[..., :16] | (nib[..., 16:] << 4)                          # GGML: low = 0-15, high = 16-31
    blocks = np.concatenate([scales[..., None], qs], -1).reshape(5, 34).astype(np.uint8)
    a, b = dequantize(packed, scales), dequantize(blocks, layout="ggml")
    assert np.array_equal(a, b)


def test_nan_scale_rejected_naming_block():
    packed = np.zeros((4, 64), np.uint8)
    scales = np.full((4, 4), 127, np.uint8)
    scales[2, 3] = 0xFF
    with pytest.raises(ValueError, match=r"^w1\.weight_scale: E8M0 scale 0xFF \(NaN\) in block 11 \(row 2, block 3"):
        dequantize(packed, scales, name="w1.weight_scale")
    blocks = np.zeros((2, 3 * 17), np.uint8)
    blocks[1, 2 * 17] = 0xFF
    with pytest.raises(ValueError, match=r"^ffn_up_exps\.weight: E8M0 scale 0xFF \(NaN\) in block 5 \(row 1, block 2"):
        dequantize(blocks, layout="ggml", name="ffn_up_exps.weight")


def test_bad_arguments():
    with pytest.raises(ValueError, match="do not match"):
        dequantize(np.zeros((4, 64), np.uint8), np.zeros((4, 3), np.uint8), name="w")
    with pytest.raises(ValueError, match="needs the E8M0 scale tensor"):
        dequantize(np.zeros((4, 64), np.uint8))
    with pytest.raises(ValueError, match="whole 17-byte blocks"):
        dequantize(np.zeros((4, 33), np.uint8), layout="ggml")
    with pytest.raises(ValueError, match="must be uint8"):
        dequantize(np.zeros((4, 64), np.float32), np.zeros((4, 4), np.uint8))
    with pytest.raises(ValueError, match="unknown MXFP4 layout 'nv'"):
        dequantize(np.zeros((4, 64), np.uint8), layout="nv")
    with pytest.raises(ValueError, match=r"scale shape \[\] do not match"):       # a 0-d scale
        dequantize(np.zeros(16, np.uint8), np.array(127, np.uint8))


def test_read_only_inputs_and_dtype():
    rng = np.random.default_rng(8)
    packed = rng.integers(0, 256, (8, 32), dtype=np.uint8)
    scales = rng.integers(120, 135, (8, 2), dtype=np.uint8)
    packed.flags.writeable = False
    scales.flags.writeable = False
    ref = dequantize(packed, scales)
    assert np.array_equal(dequantize(packed, scales, dtype=np.float16), ref.astype(np.float16))


# -- gpt-oss as shipped: *_blocks [..., G, 16] + *_scales [..., G] ----------------------------------------
def test_gpt_oss_layout_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match=r"blocks shape \[8, 4, 16\] and scale shape \[8, 3\] do not match"):
        dequantize(np.zeros((8, 4, 16), np.uint8), np.zeros((8, 3), np.uint8), layout="gpt-oss", name="down")
    with pytest.raises(ValueError, match="needs the E8M0 scales tensor"):
        dequantize(np.zeros((8, 4, 16), np.uint8), layout="gpt-oss")
    with pytest.raises(ValueError, match="unknown MXFP4 layout 'mx' \\(use one of ocp, gpt-oss, ggml\\)"):
        dequantize(np.zeros((8, 16), np.uint8), np.zeros((8, 1), np.uint8), layout="mx")
