"""CRC-32 (zlib's polynomial) of expert bytes: the checksum of packed files and the disk tier.

Every expert read from a packed file or the disk tier is checksummed before it
is served, so this sits on the cold-miss path: zlib's crc32 runs at ~4-5 GB/s
here, about a fifth of a cold batch's time on a fast disk; zlib-ng's
(``zlib-ng`` on PyPI, a declared dependency) computes the same function with
PCLMUL/VPCLMUL at ~30 GB/s and, like zlib's, releases the GIL, so reader
threads checksum in parallel.  zlib's is the fallback where zlib-ng cannot be
imported: the values are identical, so files written with one verify with the
other.

``crc32_combine`` is written here because neither Python binding exposes
zlib's: a part read by one reader thread is checksummed on its own, and the
thread that completes the expert combines the parts' crcs.

Pure functions; thread-safe.
"""

from __future__ import annotations

try:
    from zlib_ng.zlib_ng import crc32
except ImportError:                     # pragma: no cover - zlib-ng is a dependency
    from zlib import crc32

__all__ = ["crc32", "crc32_combine"]

_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC-32 polynomial (bit-reflected, as zlib)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


_X2N = [1 << 30]  # x^(2^n) mod p, n = 0..63
for _ in range(63):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32(A + B) given crc32(A), crc32(B) and len(B)."""
    # x^(8 * len2) mod p, as zlib's x2nmodp(len2, 3)
    p, k, n = 1 << 31, 3, len2
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 63], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2
