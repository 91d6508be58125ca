"""Trajectory matching: past passes whose last layers picked as this one did vote for the next.

The co-activation counts (``counts``) see pairs: expert ``a`` at layer ``m - d`` and
expert ``e`` at ``m``.  Within a request, routing also repeats whole paths (the same
kind of token takes nearly the same experts through a run of layers), which pairs
averaged over a layer's picks blur.  ``Recall`` keeps the last passes (tokens) whole
and, for a layer ``m`` of a pass in progress, weighs each past pass by how well its
layers ``m - d`` (d = 1 .. ``depth``, same pass only) overlap this pass's:

    sim(t') = sum_d temper ** (d - 1) * |picks(m - d) & picks_t'(m - d)|
    votes[e] = sum_t' sim(t') ** SHARP * [e picked at m in t'] / sum_t' sim(t') ** SHARP

a sharp power, so the closest passes decide (a near neighbour vote, not an average
over all).  ``score.mix`` shrinks the votes towards the layer's plain pick rate
``pm`` by a ``PRIOR`` share and mixes them with the naive-Bayes probability before
calibrating: the confidence stays a measured frequency of the mixed score.  Only
models of more than ``score.SMALL`` experts use it (a handful of experts leaves no
path to match).

Layout: ``x`` (``layers * experts``, ``window``), float32, one column per finished
pass, 1.0 where the pass picked the key (key-major, so a context's keys are a few
contiguous rows to gather, and a layer's experts one contiguous block to vote
with); a column never written is zeros and votes nothing.  A pass in progress is a
list of keys per client (``_open``: it has not reached the layer asked about, so it
never votes), written at its end (``end``) into the oldest column (a ring;
``_set[r]``: the keys column ``r`` holds, cleared at its reuse).

Memory, bounded by layers ``L`` x experts ``E``: ``4 * window * L * E`` bytes, the
window from ``window_for`` (``WINDOW`` passes, fewer where that passes ``BYTES``, at
least ``MIN_WINDOW``): at most max(``BYTES``, 4 * ``MIN_WINDOW`` * L * E).  4.2 MB at
Qwen3-30B's 48 x 128 (170 passes), DeepSeek-V3's 58 x 256 (70) and Kimi-K2's 61 x 384
(44).  Beside it, the keys each column holds (``_set``: window x L x k ints, k keys a
fetch) and each client's pass in progress.  Not kept across a warm restart
(``CoPredictor.state``): it is what the current requests did, not what the model does.

Pure and deterministic (no clock, randomness or I/O): the daemon and ``k3d replay``
compute the same votes.  Thread: its ``CoPredictor``'s (one caller at a time).
"""

from __future__ import annotations

import numpy as np

WINDOW = 256            # passes kept, where they fit in BYTES
MIN_WINDOW = 16
BYTES = 4 << 20         # x's bytes, above which fewer passes are kept (the daemon's RSS)
SHARP = 12.0            # a past pass votes with its similarity to this power: the closest decide
PRIOR = 0.05            # the plain rate's weight, a share of the neighbours' total


def window_for(layers: int, experts: int) -> int:
    """Passes kept for a model of ``layers`` x ``experts`` (``x`` within ``BYTES``)."""
    return max(MIN_WINDOW, min(WINDOW, BYTES // (4 * layers * experts)))


class Recall:
    def __init__(self, layers: int, experts: int, depth: int, temper: float, window: int | None = None):
        self.layers, self.experts, self.depth = layers, experts, depth
        self.window = window_for(layers, experts) if window is None else window
        self.x = np.zeros((layers * experts, self.window), np.float32)
        self._set: list[list[int]] = [[] for _ in range(self.window)]   # column -> the keys it holds
        self.next = 0                                   # the column the next finished pass takes
        self._open: dict[int, list[int]] = {}           # client -> the keys of its pass in progress
        # a context row (d - 1) * E + a's weight: distance d's (CoPredictor._context's rows)
        self.wr = np.repeat(np.array([temper ** d for d in range(depth)], np.float32), experts)
        self.any_done = False

    def nbytes(self) -> int:
        return self.x.nbytes

    def begin(self, client: int) -> None:
        """``client`` starts a pass (its first layer's fetch is next to ``learn``)."""
        self.end(client)
        self._open[client] = []

    def learn(self, client: int, m: int, picks) -> None:
        keys = self._open.get(client)
        if keys is not None:
            base = (self.layers - 1 - m) * self.experts     # (layers stored last first: see votes)
            keys += [base + e for e in picks]

    def end(self, client: int) -> None:
        """``client``'s pass is over: it takes the oldest column, and votes from now on."""
        keys = self._open.pop(client, None)
        if keys:
            r = self.next
            self.next = (r + 1) % self.window
            self.x[self._set[r], r] = 0.0
            self.x[keys, r] = 1.0
            self._set[r] = keys
            self.any_done = True

    def forget(self, client: int) -> None:
        """``client`` left mid-pass: its unfinished pass is never kept."""
        self._open.pop(client, None)

    def votes(self, m: int, rows, scale: float = 1.0) -> np.ndarray | None:
        """Each expert's vote (E,) for layer ``m``: ``scale`` times the share of the
        neighbours' weight that picked it, given the context ``rows`` of this pass
        (``CoPredictor._context``'s: ``(d - 1) * E + a`` for expert ``a`` of layer ``m -
        d``); None: nothing to match (no finished pass, or none overlapping).  Layers
        are stored last first, so layer ``m - d``'s key ``a`` is row ``(L - m) * E`` +
        the context row: one view and one gather, no index arithmetic per key."""
        if not self.any_done or not rows:
            return None
        E, top = self.experts, (self.layers - m) * self.experts
        sims = self.wr.take(rows) @ self.x[top:].take(rows, 0)
        sims *= 1.0 / len(rows)          # each at most 1 (weights <= 1): the power stays in float32's range
        sims **= SHARP
        total = float(sims.sum())
        if total <= 0.0:
            return None
        v = self.x[top - E:top] @ sims
        v *= scale / total
        return v
