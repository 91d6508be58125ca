"""MXFP4 dequantization of torch tensors: bit for bit what the numpy path and the references give.

The torch half of tests/unit/test_mxfp4.py (same inputs, same assertions), and the gpt-oss
layout against transformers' own dequantizer: kept out of the unit layer because torch and
transformers are optional extras whose import alone takes seconds.  The forward-pass tests
(test_forward.py, the hf tests) use this path on served experts.
"""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from k3client.mxfp4 import dequantize
from mxfp4_reference import bits, ocp_reference, random_ocp

# torch is optional for k3d; the test extra installs it (the CPU build, via the README's index)
torch = pytest.importorskip("torch", reason="needs torch; CPU build: "
                            "pip install torch --index-url https://download.pytorch.org/whl/cpu")


@pytest.mark.parametrize("shape", [(3, 64), (2, 3, 32), (1, 16)])
def test_ocp_matches_hand_reference(shape):
    packed, scales = random_ocp(shape)
    ref = ocp_reference(packed, scales)
    gt = dequantize(torch.from_numpy(packed), torch.from_numpy(scales))
    assert isinstance(gt, torch.Tensor) and np.array_equal(bits(gt), bits(ref))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # gguf's own inf at scale 254
def test_ggml_matches_gguf_bit_for_bit():
    rng = np.random.default_rng(5)
    blocks = rng.integers(0, 256, (4, 7, 255 // 7 + 1, 17), dtype=np.uint8)
    blocks[..., 0] = (np.arange(blocks[..., 0].size) % 255).reshape(blocks.shape[:-1])   # every scale 0..254
    data = blocks.reshape(4, 7, -1)
    ref = gguf_dequantize(data, T.MXFP4)
    gt = dequantize(torch.from_numpy(data), layout="ggml")
    assert np.array_equal(bits(gt), bits(ref))


def test_nan_scale_rejected_naming_block():
    packed = np.zeros((4, 64), np.uint8)
    scales = np.full((4, 4), 127, np.uint8)
    scales[2, 3] = 0xFF
    with pytest.raises(ValueError, match=r"block 11 \(row 2, block 3"):
        dequantize(torch.from_numpy(packed), torch.from_numpy(scales), name="w1")
    blocks = np.zeros((2, 3 * 17), np.uint8)
    blocks[1, 2 * 17] = 0xFF
    with pytest.raises(ValueError, match=r"in block 5"):
        dequantize(torch.from_numpy(blocks), layout="ggml", name="x")


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"scale shape \[\] do not match"):
        dequantize(torch.zeros(16, dtype=torch.uint8), torch.tensor(127, dtype=torch.uint8))


def test_read_only_inputs_and_dtype():
    rng = np.random.default_rng(8)
    packed = rng.integers(0, 256, (8, 32), dtype=np.uint8)
    scales = rng.integers(120, 135, (8, 2), dtype=np.uint8)
    packed.flags.writeable = False
    scales.flags.writeable = False
    ref = dequantize(packed, scales)
    tb = dequantize(torch.from_numpy(packed.copy()), torch.from_numpy(scales.copy()), dtype=torch.bfloat16)
    assert tb.dtype == torch.bfloat16 and torch.equal(tb.float(), torch.from_numpy(ref))  # exact in bf16


# -- gpt-oss as shipped: *_blocks [..., G, 16] + *_scales [..., G] ----------------------------------------
def test_gpt_oss_layout_equals_transformers():
    """The gpt-oss layout against transformers' own dequantizer (an independent implementation), and
    against the element-by-element OCP reference (tests/mxfp4_reference.py), for numpy and torch inputs."""
    transformers_mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    rng = np.random.default_rng(21)
    blocks = rng.integers(0, 256, (3, 8, 4, 16), dtype=np.uint8)       # [E, rows, G, 16]
    scales = rng.integers(100, 150, (3, 8, 4), dtype=np.uint8)         # [E, rows, G]
    ref = transformers_mxfp4.convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                        dtype=torch.float32)           # [E, G*32, rows]
    for e in range(3):
        ours = dequantize(blocks[e], scales[e], layout="gpt-oss")
        assert ours.shape == (8, 128)
        assert np.array_equal(ours, ref[e].T.numpy())        # values (+0/-0 aside, as the OCP table decides)
        assert np.array_equal(bits(ours), bits(ocp_reference(blocks[e].reshape(8, 64), scales[e])))
        t = dequantize(torch.from_numpy(blocks[e]), torch.from_numpy(scales[e]), layout="gpt-oss")
        assert np.array_equal(bits(t), bits(ours))
