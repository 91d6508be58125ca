"""The CUDA side of k3client, shared by the transformers and vLLM integrations.

- ``cuda``: the few CUDA calls k3client makes (``CudaApi``: torch's own cudart
  binding for host registration, the driver for device attributes), each failure
  drained and named in words;
- ``pinning``: the arena mapping's registration as pinned host memory, which
  follows the mapping's life (registered per mapping and generation, in chunks on
  slot boundaries; unregistered before the mapping is unmapped);
- ``streams``: expert copies on a side stream per device, with an event per expert
  that the compute stream waits on;
- ``guards``: what the integrations refuse or switch off (CUDA graphs, compile).

Nothing here touches CUDA state until a model's tensors are on a CUDA device: a CPU
model on a GPU host behaves as on a CPU host.
"""
