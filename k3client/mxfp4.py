"""MXFP4 dequantization for both byte layouts, in numpy or torch.

MXFP4 (OCP Microscaling v1.0): blocks of 32 FP4 E2M1 values sharing one E8M0
scale; value = FP4_E2M1[nibble] * 2^(scale - 127).  E8M0 0xFF is NaN: such a
block is rejected (ValueError naming the tensor and block), never decoded.

Three byte layouts (which one a served model uses is its ``tensor_format``:
``ocp:MXFP4`` for ``*.weight_packed`` + ``*.weight_scale`` pairs, ``gpt-oss:MXFP4``
for openai/gpt-oss's ``*_blocks`` + ``*_scales``, ``ggml:MXFP4`` for GGUF)::

    layout="ocp"   (OCP / compressed-tensors)
        packed  uint8 [..., K/2]    byte j = element 2j (low nibble) | element 2j+1 (high nibble)
        scales  uint8 [..., K/32]   E8M0, one per 32 consecutive elements
    layout="gpt-oss"  (openai/gpt-oss as shipped: ``gate_up_proj_blocks [E, 2I, G, 16]``)
        packed  uint8 [..., G, 16]  the OCP bytes with the blocks as their own axis
        scales  uint8 [..., G]      E8M0, one per block; K = 32 G.  The result is
                                    [..., K]: for an expert's gate_up_proj that is
                                    [2I, H], the transpose of the bf16 checkpoint's
                                    gate_up_proj[e] [H, 2I] (transformers transposes
                                    when it dequantizes)
    layout="ggml"  (GGML type 39, ``block_mxfp4``)
        packed  uint8 [..., (K/32) * 17]  per block: 1 byte E8M0, then 16 bytes qs;
                                          element i = qs[i] & 0xF, element 16+i = qs[i] >> 4
        scales  None (inside the blocks)

Result: float32 (or ``dtype``) [..., K].  Every decoded value is an FP4 value
times a power of two, so float32 holds it exactly and both layouts are
bit-exact: GGML results equal ``gguf.quants.dequantize`` bit for bit (ggml's
table has +0 for nibble 0b1000, so that decodes to +0.0 there; OCP decodes it
as the E2M1 value -0.0).  Values past float32 range (scale 254 with |FP4| >= 4)
become +-inf, as in ggml.

Inputs may be numpy arrays (or anything ``np.asarray`` takes, e.g. a read-only
``Expert.array`` view) or torch tensors (then the result is a torch tensor on
the same device; torch is imported only then).  Inputs are never written.
Pure functions: thread-safe.
"""

from __future__ import annotations

import numpy as np

# E2M1: sign bit 3, exponent bits 2-1, mantissa bit 0
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# ggml's kvalues_mxfp4 are these doubled, with +0 at 0b1000; halved here (exact)
FP4_GGML = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32
GGML_BLOCK_BYTES = 17
E8M0_NAN = 0xFF

_LUT = {"ocp": np.array(FP4_E2M1, np.float32), "ggml": np.array(FP4_GGML, np.float32)}
# byte -> (value of its low nibble, value of its high nibble): one gather decodes a byte
_PAIRS = {k: np.stack([v[np.arange(256) & 0x0F], v[np.arange(256) >> 4]], axis=-1) for k, v in _LUT.items()}
# 2^(s-127) for s = 0..254 is exact in float32 (2^-127 is a subnormal); 255 is never used
_SCALE = np.ldexp(np.float64(1.0), np.arange(256) - 127)
_SCALE[E8M0_NAN] = np.nan
_SCALE = _SCALE.astype(np.float32)


def _is_torch(x) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _nan_error(name: str, flat_index: int, per_row: int) -> ValueError:
    row, col = divmod(flat_index, per_row) if per_row else (0, flat_index)
    return ValueError(f"{name}: E8M0 scale 0xFF (NaN) in block {flat_index} "
                      f"(row {row}, block {col} of the row); the tensor is corrupt or not MXFP4")


LAYOUTS = ("ocp", "gpt-oss", "ggml")


def dequantize(packed, scales=None, layout: str = "ocp", name: str = "tensor", dtype=None):
    """Decode MXFP4 ``packed`` bytes (and ``scales`` for ``ocp`` / ``gpt-oss``) to floats."""
    if layout == "gpt-oss":
        packed, scales = _flatten_blocks(packed, scales, name)
        layout = "ocp"
    if layout not in _LUT:
        raise ValueError(f"{name}: unknown MXFP4 layout {layout!r} (use one of {', '.join(LAYOUTS)})")
    if _is_torch(packed):
        return _dequantize_torch(packed, scales, layout, name, dtype)
    packed = np.asarray(packed)
    if packed.dtype != np.uint8:
        raise ValueError(f"{name}: MXFP4 bytes must be uint8, got {packed.dtype}")
    pairs = _PAIRS[layout]
    if layout == "ocp":
        if scales is None:
            raise ValueError(f"{name}: layout 'ocp' needs the E8M0 scale tensor")
        scales = np.asarray(scales)
        _check_ocp(name, packed.shape, scales.shape, scales.dtype)
        _check_nan(name, scales)
        vals = pairs[packed]                                                   # [..., K/2, 2]
        vals = vals.reshape(packed.shape[:-1] + (scales.shape[-1], BLOCK))
        with np.errstate(over="ignore"):    # scale 254 x |FP4| >= 4 is inf, as in ggml
            out = vals * _SCALE[scales][..., None]
    else:
        if scales is not None:
            raise ValueError(f"{name}: layout 'ggml' keeps its scales inside the blocks; pass scales=None")
        blocks = _ggml_blocks(name, packed)
        e, qs = blocks[..., 0], blocks[..., 1:]
        _check_nan(name, e)
        vals = np.swapaxes(pairs[qs], -1, -2).reshape(qs.shape[:-1] + (BLOCK,))  # low 0-15, high 16-31
        with np.errstate(over="ignore"):
            out = vals * _SCALE[e][..., None]
    out = out.reshape(out.shape[:-2] + (out.shape[-2] * BLOCK,))
    return out if dtype is None else out.astype(dtype)


def _flatten_blocks(blocks, scales, name):
    """gpt-oss ``[..., G, 16]`` blocks as the OCP ``[..., 16 G]`` bytes they are (a view, no copy)."""
    if scales is None:
        raise ValueError(f"{name}: layout 'gpt-oss' needs the E8M0 scales tensor (*_scales)")
    if not _is_torch(blocks):
        blocks = np.asarray(blocks)
    bshape, sshape = tuple(blocks.shape), tuple(scales.shape)
    if len(bshape) < 2 or bshape[-1] != BLOCK // 2 or bshape[:-1] != sshape:
        raise ValueError(f"{name}: blocks shape {list(bshape)} and scale shape {list(sshape)} do not match "
                         f"(need blocks [..., G, 16] with scales [..., G])")
    return blocks.reshape(bshape[:-2] + (bshape[-2] * (BLOCK // 2),)), scales


def _check_ocp(name, pshape, sshape, sdtype) -> None:
    if str(sdtype) not in ("uint8", "torch.uint8"):
        raise ValueError(f"{name}: E8M0 scales must be uint8, got {sdtype}")
    if (len(pshape) == 0 or len(sshape) == 0 or tuple(pshape[:-1]) != tuple(sshape[:-1])
            or pshape[-1] != sshape[-1] * (BLOCK // 2)):
        raise ValueError(f"{name}: packed shape {list(pshape)} and scale shape {list(sshape)} do not match "
                         f"(need packed [..., 16n] with scales [..., n])")


def _check_nan(name: str, scales) -> None:
    bad = np.flatnonzero(scales.reshape(-1) == E8M0_NAN)
    if bad.size:
        raise _nan_error(name, int(bad[0]), scales.shape[-1] if scales.ndim else 0)


def _ggml_blocks(name: str, packed: np.ndarray) -> np.ndarray:
    if packed.ndim == 0 or packed.shape[-1] % GGML_BLOCK_BYTES:
        raise ValueError(f"{name}: GGML MXFP4 rows must be whole 17-byte blocks, got shape {list(packed.shape)}")
    return packed.reshape(packed.shape[:-1] + (packed.shape[-1] // GGML_BLOCK_BYTES, GGML_BLOCK_BYTES))


def _dequantize_torch(packed, scales, layout, name, dtype):
    import torch

    if packed.dtype != torch.uint8:
        raise ValueError(f"{name}: MXFP4 bytes must be uint8, got {packed.dtype}")
    dev = packed.device
    pairs = torch.from_numpy(_PAIRS[layout]).to(dev)
    scale_lut = torch.from_numpy(_SCALE).to(dev)
    if layout == "ocp":
        if scales is None:
            raise ValueError(f"{name}: layout 'ocp' needs the E8M0 scale tensor")
        _check_ocp(name, tuple(packed.shape), tuple(scales.shape), scales.dtype)
        _check_nan_torch(name, scales)
        vals = pairs[packed.long()]
        vals = vals.reshape(tuple(packed.shape[:-1]) + (scales.shape[-1], BLOCK))
        out = vals * scale_lut[scales.long()].unsqueeze(-1)
    else:
        if scales is not None:
            raise ValueError(f"{name}: layout 'ggml' keeps its scales inside the blocks; pass scales=None")
        if packed.dim() == 0 or packed.shape[-1] % GGML_BLOCK_BYTES:
            raise ValueError(f"{name}: GGML MXFP4 rows must be whole 17-byte blocks, got shape {list(packed.shape)}")
        blocks = packed.reshape(tuple(packed.shape[:-1]) + (packed.shape[-1] // GGML_BLOCK_BYTES, GGML_BLOCK_BYTES))
        e, qs = blocks[..., 0], blocks[..., 1:]
        _check_nan_torch(name, e)
        vals = pairs[qs.long()].transpose(-1, -2).reshape(tuple(qs.shape[:-1]) + (BLOCK,))
        out = vals * scale_lut[e.long()].unsqueeze(-1)
    out = out.reshape(tuple(out.shape[:-2]) + (out.shape[-2] * BLOCK,))
    return out if dtype is None else out.to(dtype)


def _check_nan_torch(name: str, scales) -> None:
    bad = (scales.reshape(-1) == E8M0_NAN).nonzero()
    if bad.numel():
        raise _nan_error(name, int(bad[0, 0]), scales.shape[-1] if scales.dim() else 0)
