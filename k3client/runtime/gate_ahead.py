"""Gate-ahead: the next MoE layer's experts, picked by its own router from this layer's input.

In layer L, the next MoE layer's router is applied to layer L's hidden states; the
experts it picks travel as ``predicted=`` with layer L's first fetch (one message,
``epochs``).  How the router answers is the engine's (``Layer.top_k`` of the next
layer): None, it returns its expert indices among its outputs (transformers: the one
integer tensor, ``expert_indices``); an int, it returns logits and the top ``top_k``
of each token are its experts (vLLM).  With ``skip_resident`` a layer whose experts
the shared index shows all resident is not predicted at all (they would send
nothing; ``stats.predicted`` then counts only the predictions made).

Scoring: when the next layer runs, the experts it really fetches are compared with
the pending prediction (``stats.predicted_used``: precision as this process sees it).

Owner: the model's thread (with the runtime).  State: one pending prediction.
"""

from __future__ import annotations

import torch


class GateAhead:
    def __init__(self, client, layers: dict, stats, skip_resident: bool = False):
        self.client, self.layers, self.stats = client, layers, stats
        self.skip_resident = skip_resident
        self.pending: tuple[int, set[int]] | None = None     # (next layer, experts predicted for it)

    def predict(self, ml, hidden_states):
        """``[(next layer, expert), ...]`` to send with ``ml``'s first fetch, or None."""
        nxt = self.layers.get(ml.next) if ml.next is not None else None
        if nxt is None or nxt.router is None or (
                self.skip_resident and self.client.layer_resident(nxt.layer, nxt.module.num_experts)):
            self.pending = None
            return None
        with torch.no_grad():
            routed = nxt.router(hidden_states)
        idx = picks(routed, nxt.top_k)
        if idx is None:
            self.pending = None
            return None
        experts = sorted(set(idx.reshape(-1).tolist()))
        if nxt.mine is not None:             # an expert-parallel rank predicts the experts it computes
            experts = [e for e in experts if e in nxt.mine]
        self.pending = (nxt.layer, set(experts))
        return [(nxt.layer, e) for e in experts]

    def score(self, layer: int, experts: list[int]) -> None:
        """``layer`` fetches ``experts``: count the pending prediction's hits."""
        p = self.pending
        if p is not None and p[0] == layer:
            self.stats.predicted_used += len(p[1] & set(experts))
            self.pending = None


def picks(routed, top_k: int | None):
    """The experts a router's output picks: its indices (``top_k`` None) or its logits' top-k."""
    if top_k is None:
        return expert_indices(routed)
    logits = routed[0] if isinstance(routed, tuple) else routed
    k = min(top_k, logits.shape[-1])
    return torch.topk(logits.float(), k, dim=-1).indices


def expert_indices(routed):
    """The expert indices among a router's outputs: its one integer tensor.  Families order
    their router's tuple differently (``(logits, scores, indices)``, ``(indices, weights,
    logits)``) and transformers releases have changed a family's order; None if none is."""
    if isinstance(routed, torch.Tensor):
        return routed if not routed.is_floating_point() else None
    ints = [t for t in routed if isinstance(t, torch.Tensor) and not t.is_floating_point()]
    return ints[0] if len(ints) == 1 else None
