"""``Runtime``: one loaded model's link to the daemon, engine-neutral.

An adapter (``k3client.hf``: a transformers experts call; ``k3client.vllm``: the
quant method's ``apply``) builds one ``Runtime`` per loaded model over its
``Layer``s, calls ``begin_forward`` from a pre-hook of the model's forward, and
hands every MoE layer call to ``run_layer(ml, hidden_states, top_k_index,
top_k_weights)``.  The runtime then:

- keeps the pin rule (``epochs``): one epoch per forward, groups that fit the arena;
- sends gate-ahead predictions and scores them (``gate_ahead``);
- makes the views (``views``) and computes the layer with the loop of the engine's
  numerics (``compute``): ``"eager"`` (transformers' eager experts loop, bit for
  bit; ``compute.sorted_loop`` on a CUDA device) or ``"fused"`` (vLLM's: rows sorted
  by expert, an optional ``native`` kernel for small runs, ``StepStats``);
- marks the layer's compute complete (``_layer_done``: CPU, it ran; GPU, the device
  is synchronised before any epoch boundary or release, ``Epochs._sync_device``),
  which releases the layer's pins (``Epochs.release_layer``) or, after the last MoE
  layer, begins the next epoch.

``native``: a callable ``(math, views, x_float32, reduced_dtype_or_None) -> float32
[rows, H]`` for gated experts of a ``Layer.rowmajor`` layer (``k3client.vllm.native``'s
``rowmm``, bound by the adapter); None computes with torch.  ``native_layer``: with
``native``, a callable computing a decode step's run of such experts in one call, scaled
and summed (``k3client.vllm.native.layer_experts``, bound; ``compute.fused`` says when);
None: one ``native`` call per expert.

Owner: the thread that runs the model's forward; the client is used only from it.
Nothing here imports an engine (transformers, vLLM): torch only.
"""

from __future__ import annotations

import itertools

from . import compute
from .epochs import Epochs, Stats, StepStats
from .gate_ahead import GateAhead

NUMERICS = ("eager", "fused")


class Runtime(Epochs):
    """Fetches experts for the forward in progress and computes them; see the module docstring."""

    def __init__(self, client, layers: dict, predict: bool = True, numerics: str = "eager", native=None,
                 skip_resident: bool = False, native_layer=None):
        if numerics not in NUMERICS:
            raise ValueError(f"numerics {numerics!r}: one of {NUMERICS}")
        super().__init__(client, StepStats() if numerics == "fused" else Stats())
        self.layers = layers
        self.predict = predict
        self.numerics = numerics
        self.native = native
        self.native_layer = native_layer if native is not None else None
        if numerics == "fused":
            self.stats.native_kernel = native is not None
        self.ahead = GateAhead(client, layers, self.stats, skip_resident=skip_resident)
        for a, b in itertools.pairwise(sorted(layers)):
            layers[a].next = b

    def run_layer(self, ml, hidden_states, top_k_index, top_k_weights):
        """``ml``'s routed experts for this call: the engine's numerics (module docstring)."""
        out = self._loop(hidden_states.device)(self, ml, hidden_states, top_k_index, top_k_weights)
        self._layer_done(ml)
        return out

    def _loop(self, device):
        """The ``compute`` loop for the engine's numerics on ``device``."""
        if self.numerics == "fused":
            return compute.fused
        return compute.sorted_loop if device.type == "cuda" else compute.eager_loop

    def _layer_done(self, ml) -> None:
        """``ml``'s compute is complete: no view it fetched is read again by it (CPU: the compute
        ran; GPU: queued, and every epoch boundary or release synchronises the devices first).
        The last MoE layer begins the next forward's epoch; another releases its pins of this
        epoch (``Epochs.release_layer``)."""
        if ml.next is None:
            self._begin_next()
        else:
            self.release_layer(ml.layer)
