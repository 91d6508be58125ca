"""Where each client's pass (token) stands, as ``CoPredictor`` reads it: the context a
fetch of a layer is scored against, the layer the client fetches next, the layer its
next pass begins with, and the keys its pass still needs.

``Passes`` is a base of ``CoPredictor`` (coact.py) and holds no state of its own; it
reads what the predictor keeps per client and per layer (coact.py's ``__init__``):

- ``_recent[client]``: [(layer, picks)] of the client's current pass, newest last, at
  most ``depth`` of them; ``_prev[client]``: the same for its previous pass;
- ``_starts[client]``: (its last pass's first layer, the first layer of the one before);
- ``_k[client]``: keys in its last fetch;
- ``_ends[layer]`` / ``_goes[layer]``: passes (every client's) that ended at the layer /
  went on past it; ``_fetched[layer]``: the layer was ever fetched;
- ``_ctx[client]``: (target layer, ``_context``'s answer), the one entry written here.

Invariants: the predictor alone updates them (``observe``, ``end_pass``, ``forget``, a
change of shape, ``restore``), and drops ``_ctx[client]`` at each of the client's
fetches, so ``_context``'s cached answer is never older than the client's last fetch.
The answers here are functions of the access stream alone, as the predictor's are.

Thread: the predictor's one caller (the daemon's server thread, or replay).
"""

from __future__ import annotations


class Passes:
    """The per-client pass queries of the predictor API (``k3d.cache.predict``)."""

    def _context(self, client: int, m: int) -> tuple:
        """The client's context for layer ``m``: (((distance, picks), ...), the rows of
        ``seen``/``co`` they name, the picks' sizes).  Cached until the client's next fetch."""
        got = self._ctx.get(client)
        if got is not None and got[0] == m:
            return got[1]
        D, E = self.depth, self.experts
        hist = self._recent.get(client)
        if hist:
            parts = tuple([(d, picks) for layer, picks in hist if 1 <= (d := m - layer) <= D])
        else:                                      # the pass's first layer: the previous pass's end
            top = m + self.layers
            parts = tuple([(d, picks) for layer, picks in self._prev.get(client, ()) if 1 <= (d := top - layer) <= D])
        rows = [(d - 1) * E + a for d, picks in parts for a in picks]
        ctx = (parts, rows, tuple(len(picks) for _, picks in parts))
        self._ctx[client] = (m, ctx)
        return ctx

    def next_layer(self, client: int) -> int | None:
        """The first layer after ``client``'s last fetch in this pass that has been
        fetched before (a model may have dense layers between its MoE layers); None:
        none yet, the last fetch was the last such layer (the next one is in the
        next token: ``first_layer``), or passes (every client's) more often ended at
        the last fetch's layer than went on past it: its next fetch is likely a new
        token's, and a prediction is released unused at the token's end."""
        hist = self._recent.get(client)
        if not hist:
            return None
        last = hist[-1][0]
        if self._ends[last] > self._goes[last]:
            return None
        f = self._fetched
        for m in range(last + 1, self.layers):
            if f[m]:
                return m
        return None

    def first_layer(self, client: int) -> int | None:
        """The layer ``client``'s next pass begins with (the one its last pass began
        with), when its current pass is over (``end_pass``) and it has one before whose
        first layer was that of the pass before it (or it has had one pass only); else
        None: passes that begin at changing layers (a client fetching one layer per
        token) say nothing of where the next begins."""
        if self._recent.get(client) or not self._prev.get(client):
            return None
        st = self._starts.get(client)
        if st is None or (st[1] is not None and st[0] != st[1]):
            return None
        return st[0]

    def remaining(self, client: int) -> int:
        """Keys ``client``'s current pass still needs (layers after its last, times its
        last fetch's size; every layer at a pass's start): what a prediction must
        leave room for."""
        hist = self._recent.get(client)
        if not hist:
            return self.layers * self._k.get(client, 0) if self._prev.get(client) else 0
        return (self.layers - 1 - hist[-1][0]) * self._k.get(client, 0)

    def fetch_size(self, client: int) -> int:
        """Keys in ``client``'s last fetch (0: none yet)."""
        return self._k.get(client, 0)

    def clients(self):
        return self._recent.keys() | self._prev.keys()
