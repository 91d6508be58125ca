"""A runtime's CUDA side: which devices the model uses, the arena's registration, the copies.

``GpuSide`` is created with every runtime (``epochs.Epochs``) and does nothing until the model's tensors
are on a CUDA device (``use``): the device decides, not ``torch.cuda.is_available()``,
so a CPU model on a GPU host behaves as on a CPU host (no registration, no CUDA call).
Then:

- registration (``k3client.gpu.pinning``): at load when the model is already on a CUDA
  device (``device_map``, vLLM), else in the first forward that runs on one; again for
  each new arena after a daemon restart (``follow``, from the runtime's restart check);
  the client calls ``before_unmap`` before it unmaps an arena (``close``, a re-attach),
  which synchronises every device the model used and unregisters that mapping;
- copies (``k3client.gpu.streams``): each fetched group's views go to the device on a
  copy stream, one event per expert that the compute stream waits on;
- the pin rule: ``sync`` synchronises every device with copies or compute queued since
  the last one (not only the current device: a model on ``cuda:1``, or split across
  GPUs), and the runtime calls it before every ``begin_token`` (a forward's or a
  mid-forward epoch's) and before it releases a layer (``Epochs.release_layer``).

The compute on a CUDA device is ``compute.sorted_loop``'s (transformers) or
``compute.fused``'s (vLLM); both stage their groups through ``groups``.

Owner: the model's thread.  ``api_factory`` builds the CUDA calls on first use
(``k3client.gpu.cuda.CudaApi``; tests pass a stand-in).
"""

from __future__ import annotations

import torch

from ..gpu.cuda import CudaApi
from ..gpu.pinning import Pinning
from ..gpu.streams import Copier


class GpuSide:
    def __init__(self, client, api_factory=None):
        self.pinning = Pinning(api_factory or CudaApi)
        self.copier = Copier()
        self.devices: set[torch.device] = set()    # CUDA devices the model has used
        self._work: set[torch.device] = set()      # ... with work queued since the last sync
        # no reference to the client from here: a client dropped without close() is collected
        client.before_unmap.append(self.before_unmap)

    # -- registration -------------------------------------------------------------
    def use(self, client, devices) -> None:
        """The model runs on ``devices`` (CUDA ones count): register the arena for them."""
        new = {torch.device(d) for d in devices} - self.devices
        if not any(d.type == "cuda" for d in new):
            return
        self.devices |= {d if d.index is not None else torch.device("cuda", torch.cuda.current_device())
                         for d in new if d.type == "cuda"}
        self.follow(client)

    def follow(self, client) -> None:
        """Register the arena the client maps now, once per mapping and generation (attribute 113
        is checked on the devices known then)."""
        if self.devices and client.arena is not None:
            self.pinning.register(client.arena, client.gen, client.slot_bytes, self.devices)

    def before_unmap(self, mm) -> None:
        """The client's hook: ``mm`` is about to be unmapped."""
        self.pinning.release(mm, self.sync_all)

    # -- the pin rule -----------------------------------------------------------------
    def mark(self, device: torch.device) -> None:
        self._work.add(device)

    def sync(self) -> None:
        """Wait for every device with copies or compute queued since the last sync."""
        if self._work:
            api = self.pinning.api
            for d in sorted(self._work, key=str):
                api.synchronize(d)
            self._work.clear()

    def sync_all(self) -> None:
        self._work |= self.devices
        self.sync()

    # -- copies -----------------------------------------------------------------------
    def groups(self, client, groups, device: torch.device):
        """``groups`` unchanged off CUDA; on it, each group staged on the copy stream."""
        if device.type != "cuda":
            return groups
        self.use(client, (device,))
        return self._staged(client, groups, device)

    def _staged(self, client, groups, device):
        for group in groups:
            self.mark(device)
            self.follow(client)      # a restart during that fetch: the new arena, registered first
            yield self.copier.stage(group, device)


def cuda_devices(module) -> set[torch.device]:
    """The CUDA devices holding ``module``'s parameters or buffers."""
    return {t.device for t in (*module.parameters(), *module.buffers()) if t.device.type == "cuda"}
