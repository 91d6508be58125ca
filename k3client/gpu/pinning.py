"""The arena mapping registered as pinned host memory, for as long as it is mapped.

Layout: one ``Registration`` per (mapping, daemon generation): the client's
read-only mmap of one arena, cut into chunks of at most ``CHUNK_LIMIT`` bytes that
end on slot boundaries (``plan_chunks``: a slot, hence every expert view, lies in
one chunk, and chunks never share a page since slots are 4096-aligned).  One call
per chunk: R580+ drivers fail one call of >= 512 GiB.

Invariants:

- registrations are keyed by the mapping object and the generation, never by the
  address alone: a restarted daemon's arena, even mapped at the same address as the
  old one, is registered anew, because the old one was unregistered first;
- ``release(mm)`` runs before ``mm`` is unmapped (the client's ``before_unmap``
  hook): every device that may still read it is synchronised, then each chunk is
  unregistered.  The driver keeps a registration, and its pinned pages, after
  ``munmap``: without this the copies of a new arena at the same address would read
  the dead one's pages, and an arena at another address would stay pinned;
- a failed call leaves no pending CUDA error (``CudaApi.last_error`` drains it),
  warns once per mapping naming the error in words, undoes the chunks done so far,
  and the copies stay pageable: correct, only slower;
- registration is asked only read-only (``cudaHostRegisterReadOnly``: the mapping is
  PROT_READ), so it needs device attribute 113 on every device the model uses;
  without it the arena is not registered (warned).

A client dropped without ``close()`` skips ``release``: its last registration, and the
pages it pins, then last until the process exits.

Owner: the thread that runs the model (the client's thread).
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass

import numpy as np

from .cuda import REGISTER_PORTABLE, REGISTER_READ_ONLY

CHUNK_LIMIT = 64 << 30
log = logging.getLogger("k3client.gpu")


def address_of(mm) -> int:
    """Start address of a (read-only) mmap, without a writable buffer."""
    return int(np.frombuffer(mm, dtype=np.uint8, count=1).ctypes.data)


def plan_chunks(size: int, slot_bytes: int, limit: int = CHUNK_LIMIT) -> list[tuple[int, int]]:
    """``[(offset, bytes)]`` covering ``size`` bytes, each <= ``limit`` (or one slot, if larger)
    and ending on a slot boundary except the last, which takes the arena's tail."""
    per = max(1, limit // slot_bytes) * slot_bytes
    return [(off, min(per, size - off)) for off in range(0, size, per)]


@dataclass
class Registration:
    mm: object
    gen: object
    chunks: list            # [(address, bytes)] registered
    seconds: float

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.chunks)


class Pinning:
    """Registrations of this runtime's arena mappings; see the module docstring."""

    def __init__(self, api_factory):
        self._api_factory = api_factory
        self._api = None
        self.registered: dict[tuple[int, object], Registration] = {}
        self._failed: set[tuple[int, object]] = set()     # warned once, not retried

    @property
    def api(self):
        if self._api is None:
            self._api = self._api_factory()
        return self._api

    def is_registered(self, mm, gen) -> bool:
        return (id(mm), gen) in self.registered

    def register(self, mm, gen, slot_bytes: int, devices) -> bool:
        """Register ``mm`` (generation ``gen``) once; True when it is (now or before)."""
        if mm is None:
            return False
        key = (id(mm), gen)
        if key in self.registered:
            return True
        if key in self._failed:
            return False
        api = self.api
        for d in sorted(devices, key=str):
            if api.read_only_supported(d.index or 0) is False:
                return self._fail(key, f"{d} cannot register read-only host memory (device attribute 113 is 0)")
        base, t0, done = address_of(mm), time.perf_counter(), []
        for off, n in plan_chunks(len(mm), slot_bytes, CHUNK_LIMIT):
            err = api.register(base + off, n, REGISTER_PORTABLE | REGISTER_READ_ONLY)
            if err:
                api.last_error()                  # the runtime's copy of err: not left pending
                for addr, _ in done:
                    if api.unregister(addr):
                        api.last_error()
                return self._fail(key, f"cudaHostRegister of {n} bytes at arena offset {off} failed: "
                                       f"{api.error_text(err)}")
            done.append((base + off, n))
        reg = Registration(mm, gen, done, time.perf_counter() - t0)
        self.registered[key] = reg
        log.info("k3client: arena (generation %s, %.2f GiB) registered as pinned read-only host memory "
                 "in %d chunk(s), %.2f s", gen, reg.nbytes / 2**30, len(done), reg.seconds)
        return True

    def _fail(self, key, why: str) -> bool:
        self._failed.add(key)
        warnings.warn(f"k3client: {why}; expert copies to the GPU stay pageable (slower, still correct)",
                      RuntimeWarning, stacklevel=3)
        return False

    def release(self, mm, synchronize) -> None:
        """Before ``mm`` is unmapped: ``synchronize()`` (every device that may read it), then
        unregister each of its chunks.  A failure is drained and warned; the unmap goes on."""
        keys = [k for k, r in self.registered.items() if r.mm is mm]
        self._failed = {k for k in self._failed if k[0] != id(mm)}
        if not keys:
            return
        synchronize()
        api = self.api
        for k in keys:
            reg = self.registered.pop(k)
            for addr, n in reg.chunks:
                err = api.unregister(addr)
                if err:
                    api.last_error()
                    warnings.warn(f"k3client: cudaHostUnregister of {n} bytes failed: {api.error_text(err)}",
                                  RuntimeWarning, stacklevel=2)
