"""GPU hosts: the arena mapping registered once per process as pinned host memory.

``cudaHostRegister`` (through torch's own cudart binding, ``torch.cuda.cudart()``)
page-locks the read-only arena mapping with ``cudaHostRegisterReadOnly`` (the GPU
may only read it, as the kernel already enforces for the process), so H2D copies
of expert views run at pinned speed and asynchronously (``non_blocking=True``).
One registration per mapping: a re-attach after a daemon restart maps a new arena
and registers that one; a mapping is unregistered when the client closes it
(the kernel drops the registration with the mapping in any case).

Called only where ``torch.cuda.is_available()``; CPU hosts never import CUDA state.
A failed registration (e.g. a locked-memory limit) warns and leaves copies pageable:
correct, only slower.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

REGISTER_PORTABLE = 0x01
REGISTER_READ_ONLY = 0x08

_registered: dict[int, int] = {}    # address -> bytes, this process


def address_of(mm) -> int:
    """Start address of a (read-only) mmap, without a writable buffer."""
    return int(np.frombuffer(mm, dtype=np.uint8, count=1).ctypes.data)


def host_register(mm) -> bool:
    """Page-lock ``mm`` for the GPU once; True when registered (now or before)."""
    if mm is None:
        return False
    addr, size = address_of(mm), len(mm)
    if addr in _registered:
        return True
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(addr, size, REGISTER_PORTABLE | REGISTER_READ_ONLY)
    if int(err) != 0:
        warnings.warn(f"k3client.hf: cudaHostRegister of the {size}-byte arena failed ({err}); "
                      "expert copies to the GPU stay pageable (slower, still correct)", stacklevel=2)
        return False
    _registered[addr] = size
    return True


def host_unregister(mm) -> None:
    addr = address_of(mm)
    if _registered.pop(addr, None) is not None:
        torch.cuda.cudart().cudaHostUnregister(addr)
