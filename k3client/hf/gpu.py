"""The runtime's CUDA side, where ``k3client.hf`` code and its tests name it.

``GpuSide`` and ``cuda_devices`` live in ``k3client.runtime.gpu`` (both integrations use
them); ``address_of`` in ``k3client.gpu.pinning``.  Re-exported here, nothing else.
"""

from __future__ import annotations

from ..gpu.pinning import address_of
from ..runtime.gpu import GpuSide, cuda_devices

__all__ = ["GpuSide", "address_of", "cuda_devices"]
