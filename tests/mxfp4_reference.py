"""Hand-written MXFP4 references the unit and torch tests compare ``k3client.mxfp4`` with.

Written from the OCP MX spec, element by element, independent of the module's tables.
Pure functions.
"""

import numpy as np


def e2m1(nibble: int) -> float:
    """FP4 E2M1 from its bits, written out from the OCP MX spec (independent of the module's table)."""
    sign = -1.0 if nibble & 0b1000 else 1.0
    exp = (nibble >> 1) & 0b11
    man = nibble & 1
    mag = man * 0.5 if exp == 0 else (1.0 + man / 2) * 2.0 ** (exp - 1)
    return sign * mag


def ocp_reference(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Element by element: byte j holds element 2j (low nibble) and 2j+1 (high nibble)."""
    rows = packed.reshape(-1, packed.shape[-1])
    srows = scales.reshape(-1, scales.shape[-1])
    out = np.zeros((rows.shape[0], rows.shape[1] * 2), np.float32)
    for r in range(rows.shape[0]):
        for j, byte in enumerate(rows[r]):
            for k, nib in ((2 * j, int(byte) & 0xF), (2 * j + 1, int(byte) >> 4)):
                v = e2m1(nib) * 2.0 ** (int(srows[r, k // 32]) - 127)
                out[r, k] = v if abs(v) <= float(np.finfo(np.float32).max) else np.copysign(np.inf, v)
    return out.reshape(packed.shape[:-1] + (packed.shape[-1] * 2,))


def bits(a) -> np.ndarray:
    """The float32 bit patterns of a numpy array or a (CPU) torch tensor, for bit-exact compares."""
    a = a.numpy() if hasattr(a, "numpy") and not isinstance(a, np.ndarray) else a
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def random_ocp(shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Packed OCP bytes and E8M0 scales of ``shape`` (seeded by it), the first scales set to
    subnormal and extreme values."""
    rng = np.random.default_rng(sum(shape))
    packed = rng.integers(0, 256, shape, dtype=np.uint8)
    scales = rng.integers(0, 255, shape[:-1] + (shape[-1] // 16,), dtype=np.uint8)
    flat = scales.reshape(-1)
    flat[:3] = [0, 1, 254][:flat.size]
    return packed, scales
