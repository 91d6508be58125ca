"""CRC-32 (zlib's polynomial) of expert bytes: the checksum of packed files and the disk tier.

Every expert read from a packed file or the disk tier is checksummed before it
is served, so this sits on the cold-miss path, where zlib's crc32 is a
noticeable share of a cold batch's time on a fast disk; zlib-ng's (``zlib-ng``
on PyPI, a declared dependency) computes the same function with PCLMUL/VPCLMUL,
several times faster, and, like zlib's, releases the GIL, so reader threads
checksum in parallel (bench/README.md, "checksums").  zlib's is the fallback where zlib-ng cannot be
imported: the values are identical, so files written with one verify with the
other.

``crc32_combine`` is written here because neither Python binding exposes
zlib's: a part read by one reader thread is checksummed on its own, and the
thread that completes the expert combines the parts' crcs.

``CrcPipeline`` takes the checksum off a reader's critical path: a companion
thread folds piece k into the running crc while its reader already waits on
piece k+1's read, so the reader's requests go out back to back as a raw
reader's would.  Only the last piece's crc is left after the last read.

Thread-safety: ``crc32``, ``crc32_combine`` and ``crc32_of_parts`` are pure.  A ``CrcPipeline``
belongs to one caller thread at a time (``feed``/``finish`` from that thread
only; ``close()`` from any thread, between runs); its companion only reads the
pieces it is fed.  Caller's obligation: a piece's memory must stay valid and
unchanged until ``finish()`` returns, and ``finish()`` must be called (also
when the read fails part-way) before the memory is handed on: after
``finish()`` returns the companion holds no piece.  A ``finish()`` cut short
by an exception does not wait for the companion, so its pieces may still be
read after it: only a thread that can be interrupted so (the main thread)
must not then reuse that memory at once.
"""

from __future__ import annotations

import queue
import threading

try:
    from zlib_ng.zlib_ng import crc32
except ImportError:                     # pragma: no cover - zlib-ng is a dependency
    from zlib import crc32

__all__ = ["crc32", "crc32_combine", "crc32_of_parts"]

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


def crc32_of_parts(parts) -> int:
    """crc32 of the parts' bytes joined in offset order, from ``(offset, length, crc)``
    of each part (read and checksummed separately, by several threads)."""
    whole, first = 0, True
    for _, length, c in sorted(parts):
        whole = c if first else crc32_combine(whole, c, length)
        first = False
    return whole


_END, _STOP = object(), object()


class CrcPipeline:
    """Running crc32 of pieces fed in order, computed on a companion thread.

    ``feed(piece)`` returns at once; ``finish()`` waits until every piece fed
    since the last ``finish()`` is folded in and returns their crc32 (0 for
    none), starting the next run from zero.  Runs are numbered, so a
    ``finish()`` cut short (a signal's exception in the main thread) never
    hands its result to the next run.  ``close()`` ends the companion; a
    ``finish()`` waiting meanwhile, and any call afterwards, raises
    RuntimeError."""

    def __init__(self, name: str = "k3d-crc"):
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._result: queue.SimpleQueue = queue.SimpleQueue()
        self._run_no = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def feed(self, piece) -> None:
        if self._closed:
            raise RuntimeError("crc pipeline is closed")
        self._todo.put(piece)

    def finish(self) -> int:
        if self._closed:
            raise RuntimeError("crc pipeline is closed")
        self._run_no += 1
        self._todo.put((_END, self._run_no))
        while True:
            run_no, result = self._result.get()
            if run_no is None:                  # closed while waiting
                raise RuntimeError("crc pipeline closed during a run")
            if run_no != self._run_no:          # an interrupted earlier run's result
                continue
            if isinstance(result, BaseException):
                raise result
            return result

    def close(self) -> None:
        self._closed = True
        self._todo.put(_STOP)
        self._thread.join()
        self._result.put((None, None))

    def _run(self) -> None:
        crc, error = 0, None
        while True:
            piece = self._todo.get()
            if piece is _STOP:
                return
            if isinstance(piece, tuple) and piece and piece[0] is _END:
                self._result.put((piece[1], error if error is not None else crc))
                crc, error = 0, None
            elif error is None:
                try:
                    crc = crc32(piece, crc)
                except BaseException as e:      # handed to the reader at finish(), never lost
                    error = e
