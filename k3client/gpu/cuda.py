"""``CudaApi``: the CUDA calls k3client makes, and what each leaves behind.

Registration goes through torch's own cudart binding (``torch.cuda.cudart()``:
``cudaHostRegister(ptr, size, flags)``, ``cudaHostUnregister(ptr)``, both returning
the ``cudaError_t`` without raising).  A failed runtime call also sets the
runtime's per-thread *last error*; torch's binding does not clear it, so the next,
unrelated kernel launch would raise it (misattributed).  ``last_error`` drains it
through the same runtime (``cudaGetLastError`` of the ``libcudart`` torch loaded,
found in ``/proc/self/maps``; where torch links cudart statically, a one-element
kernel launch whose launch check consumes the error).  The caller drains after
every failed call (``pinning.py`` does), so no error is left pending.

Device attribute 113 (``CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED``)
comes from the driver (``libcuda.so.1``, ``cuDeviceGetAttribute``): driver-API
errors never touch the runtime's last error.

Any thread; every call is on the device the caller names (none is current-device
dependent except registration, which is ``PORTABLE``: valid in every context).
Tests replace the whole object with a stand-in of the same methods
(``tests/unit/test_gpu_pinning.py``'s ``FakeCuda``).
"""

from __future__ import annotations

import ctypes

import torch

REGISTER_PORTABLE = 0x01
REGISTER_READ_ONLY = 0x08
ATTR_HOST_REGISTER_SUPPORTED = 99
ATTR_READ_ONLY_HOST_REGISTER_SUPPORTED = 113

# the codes a registration meets, by name (cudaGetErrorString gives the sentence)
NAMES = {
    0: "cudaSuccess", 1: "cudaErrorInvalidValue", 2: "cudaErrorMemoryAllocation",
    3: "cudaErrorInitializationError", 100: "cudaErrorNoDevice", 201: "cudaErrorDeviceUninitialized",
    304: "cudaErrorOperatingSystem", 700: "cudaErrorIllegalAddress",
    712: "cudaErrorHostMemoryAlreadyRegistered", 713: "cudaErrorHostMemoryNotRegistered",
    801: "cudaErrorNotSupported", 999: "cudaErrorUnknown",
}


def describe(code: int, sentence: str | None = None) -> str:
    """``cudaErrorMemoryAllocation (2: out of memory)``: the error in words, never ``cudaError.???``."""
    name = NAMES.get(int(code), "cudaError")
    return f"{name} ({int(code)}: {sentence})" if sentence else f"{name} ({int(code)})"


class CudaApi:
    """The real calls; see the module docstring."""

    def __init__(self):
        self._rt = torch.cuda.cudart()
        self._get_last = _runtime_get_last_error()
        self._driver = _driver()

    def register(self, addr: int, size: int, flags: int) -> int:
        return int(self._rt.cudaHostRegister(addr, size, flags))

    def unregister(self, addr: int) -> int:
        return int(self._rt.cudaHostUnregister(addr))

    def last_error(self) -> int:
        """The runtime's pending error, cleared (``cudaGetLastError``)."""
        if self._get_last is not None:
            return int(self._get_last())
        try:        # no libcudart of torch's to call: a launch check consumes it
            torch.ones(1, device="cuda").add_(1)
        except RuntimeError:
            return 999
        return 0

    def error_text(self, code: int) -> str:
        try:
            sentence = self._rt.cudaGetErrorString(self._rt.cudaError(int(code)))
        except (TypeError, ValueError):
            sentence = None
        return describe(code, sentence)

    def read_only_supported(self, device: int) -> bool | None:
        """Attribute 113 of ``device``; None where the driver cannot be asked."""
        if self._driver is None:
            return None
        dev, value = ctypes.c_int(), ctypes.c_int(-1)
        if self._driver.cuDeviceGet(ctypes.byref(dev), int(device)) != 0:
            return None
        rc = self._driver.cuDeviceGetAttribute(ctypes.byref(value), ATTR_READ_ONLY_HOST_REGISTER_SUPPORTED, dev)
        return bool(value.value) if rc == 0 else None

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)


def _runtime_get_last_error():
    """``cudaGetLastError`` of the libcudart this process already loaded (torch's), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            fn = ctypes.CDLL(path).cudaGetLastError     # already loaded: the same handle, the same state
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = []
        return fn
    return None


def _driver():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    for name in ("cuDeviceGet", "cuDeviceGetAttribute"):
        getattr(lib, name).restype = ctypes.c_int
    return lib
