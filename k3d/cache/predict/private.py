"""One predictor per client behind the predictor API: learning that is not shared.

The daemon runs one predictor for every client of a model, so what one process
teaches helps the others.  ``PerClient`` is the counterfactual ``k3d replay
--clients N --learn private`` needs to measure that gain apart from the shared
arena's: each client gets a predictor of its own (``make()``, built at its first
call), which learns from that client's stream only and proposes only for it.
Everything else (the arena, the budget, ``AutoPrefetch``'s room and precision
rules) stays as it is.

Invariant: a client's calls reach its own predictor and no other, so the result
is that of N independent predictors; ``clients`` and ``remaining`` still cover
every client (``AutoPrefetch`` leaves room for all of them).
"""

from __future__ import annotations

from typing import Callable


class PerClient:
    def __init__(self, make: Callable[[], object]):
        self._make = make
        self._of: dict[int, object] = {}
        probe = make()
        self.name, self.layers, self.experts = probe.name, probe.layers, probe.experts

    def _p(self, client: int):
        p = self._of.get(client)
        if p is None:
            p = self._of[client] = self._make()
        return p

    def observe(self, client: int, keys) -> None:
        self._p(client).observe(client, keys)

    def propose(self, client: int, layer: int, budget: int, resident=(), floor: float = 0.0, room=None):
        return self._p(client).propose(client, layer, budget, resident, floor, room)

    def end_pass(self, client: int) -> None:
        self._p(client).end_pass(client)

    def next_layer(self, client: int):
        return self._p(client).next_layer(client)

    def first_layer(self, client: int):
        return self._p(client).first_layer(client)

    def remaining(self, client: int) -> int:
        return self._p(client).remaining(client)

    def fetch_size(self, client: int) -> int:
        return self._p(client).fetch_size(client)

    def forget(self, client: int) -> None:
        p = self._of.get(client)
        if p is not None:
            p.forget(client)

    def clients(self):
        return [c for c, p in self._of.items() if c in p.clients()]
