"""The transformers adapter's side of the runtime: a ``Layer`` per experts module, one ``Runtime``.

transformers 5 calls an experts module as ``fn(self, hidden_states, top_k_index,
top_k_weights)`` (``ExpertsInterface``, ``loader.k3d_experts_forward``); the adapter
hands that call unchanged to ``k3client.runtime.Runtime.run_layer`` with the
module's ``Layer``.  What transformers gives the runtime:

- ``module``: the experts module itself (``num_experts``, ``act_fn``, gpt-oss's
  ``_apply_gate``), read by the family's math, never its (meta) weights;
- ``router``: the block's ``gate``/``router``, whose output holds the expert indices
  (``top_k`` None: ``gate_ahead.expert_indices`` finds them);
- numerics ``"eager"``: the eager experts loop's order and dtypes, so the logits equal
  ``experts_implementation="eager"`` bit for bit (``compute.eager_loop``, and
  ``compute.sorted_loop`` on a CUDA device).

Owner: the thread that loaded the model (see ``loader``).
"""

from __future__ import annotations

from ..runtime import Layer, Runtime


def layer(index: int, module, router, family, specs, dtype) -> Layer:
    """The runtime's ``Layer`` for one transformers experts module, given its daemon layout."""
    return Layer(index, module, router, family, tuple(s.name for s in specs), dtype, specs=specs)


def runtime(client, layers: dict[int, Layer], predict: bool = True) -> Runtime:
    """The runtime of one transformers model: eager's numerics, predictions of every layer."""
    return Runtime(client, layers, predict=predict, numerics="eager")
