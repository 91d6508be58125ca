"""Trajectory matching: past passes whose last layers picked as this one did vote for the next.

The co-activation counts (``counts``) see pairs: expert ``a`` at layer ``m - d`` and
expert ``e`` at ``m``.  Within a request, routing also repeats whole paths (the same
kind of token takes nearly the same experts through a run of layers), which pairs
averaged over a layer's picks blur.  ``Recall`` keeps the last passes (tokens) whole
and, for a layer ``m`` of a pass in progress, weighs each past pass by how well its
layers ``m - d`` (d = 1 .. ``depth``, same pass only) overlap this pass's:

    sim(t') = sum_d temper ** (d - 1) * |picks(m - d) & picks_t'(m - d)|
    votes[e] = (sum_t' sim(t') ** SHARP * [e picked at m in t'] + PRIOR * W * pm[e]) / (W + PRIOR * W)

with ``W = sum_t' sim(t') ** SHARP``: a sharp power, so the closest passes decide
(a near neighbour vote, not an average over all), shrunk towards the layer's plain
pick rate ``pm`` by a ``PRIOR`` share.  ``CoPredictor`` mixes ``votes`` with its
naive-Bayes probability (``score.mix``) before calibrating: the confidence stays a
measured frequency of the mixed score.  Only models of more than ``score.SMALL``
experts use it (a handful of experts leaves no path to match).

Layout: ``x`` (rows ``window``, ``layers * experts``), float32, one row per pass, 1.0
where the pass picked the key; ``done[r]``: row ``r`` holds a finished pass (only those
vote: a pass in progress has not reached the layer asked about).  Rows are reused in
order (a ring); a client whose row is taken for a newer pass loses the rest of its
own (it votes nowhere, nothing else changes).

Memory, bounded by layers ``L`` x experts ``E``: ``4 * window * L * E`` bytes, the
window from ``window_for`` (``WINDOW`` passes, fewer where that passes ``BYTES``, at
least ``MIN_WINDOW``): at most max(``BYTES``, 4 * ``MIN_WINDOW`` * L * E).  6.3 MB at
Qwen3-30B's 48 x 128 (256 passes), 8.4 MB at DeepSeek-V3's 58 x 256 (141), 8.4 MB at
Kimi-K2's 61 x 384 (89).  Not kept across a warm restart (``CoPredictor.state``): it
is what the current requests did, not what the model does.

Pure and deterministic (no clock, randomness or I/O): the daemon and ``k3d replay``
compute the same votes.  Thread: its ``CoPredictor``'s (one caller at a time).
"""

from __future__ import annotations

import numpy as np

WINDOW = 256            # passes kept, where they fit in BYTES
MIN_WINDOW = 16
BYTES = 8 << 20         # x's bytes, above which fewer passes are kept
SHARP = 12.0            # a past pass votes with its similarity to this power: the closest decide
PRIOR = 0.05            # the plain rate's weight, a share of the neighbours' total


def window_for(layers: int, experts: int) -> int:
    """Passes kept for a model of ``layers`` x ``experts`` (``x`` within ``BYTES``)."""
    return max(MIN_WINDOW, min(WINDOW, BYTES // (4 * layers * experts)))


class Recall:
    def __init__(self, layers: int, experts: int, depth: int, temper: float, window: int | None = None):
        self.layers, self.experts, self.depth = layers, experts, depth
        self.window = window_for(layers, experts) if window is None else window
        self.x = np.zeros((self.window, layers * experts), np.float32)
        self.done = np.zeros(self.window, np.float32)   # 1.0: a finished pass (a factor of its vote)
        self.owner: list[int | None] = [None] * self.window
        self.next = 0                                   # the row the next pass takes
        self.row: dict[int, int] = {}                   # client -> its pass's row
        self.wd = [temper ** d for d in range(depth)]   # distance d + 1's weight
        self.any_done = False

    def nbytes(self) -> int:
        return self.x.nbytes

    def begin(self, client: int) -> None:
        """``client`` starts a pass (its first layer's fetch is next to ``learn``)."""
        self.end(client)
        r = self.next
        self.next = (r + 1) % self.window
        was = self.owner[r]
        if was is not None and self.row.get(was) == r:  # a pass still in progress: it stops here
            del self.row[was]
        self.x[r] = 0.0
        self.done[r] = 0.0
        self.owner[r] = client
        self.row[client] = r

    def learn(self, client: int, m: int, picks) -> None:
        r = self.row.get(client)
        if r is not None:
            base = m * self.experts
            self.x[r, [base + e for e in picks]] = 1.0

    def end(self, client: int) -> None:
        """``client``'s pass is over: its row votes from now on."""
        r = self.row.pop(client, None)
        if r is not None:
            self.done[r] = 1.0
            self.owner[r] = None
            self.any_done = True

    def forget(self, client: int) -> None:
        """``client`` left mid-pass: its unfinished row never votes."""
        r = self.row.pop(client, None)
        if r is not None:
            self.owner[r] = None

    def votes(self, m: int, parts, pm: np.ndarray) -> np.ndarray | None:
        """Each expert's vote (E,) for layer ``m`` given the pass's context ``parts``
        ((distance, picks), as ``CoPredictor._context``; those reaching before this
        pass are skipped); None: nothing to match (no finished pass, no context in
        this pass, or no past pass overlapping it)."""
        if not self.any_done:
            return None
        E = self.experts
        cols, w = [], []
        for d, picks in parts:
            if d <= m and d <= self.depth:
                cols += [(m - d) * E + a for a in picks]
                w += [self.wd[d - 1]] * len(picks)
        if not cols:
            return None
        sims = self.x.take(cols, 1) @ np.array(w, np.float32)
        sims *= self.done
        sims **= SHARP
        total = float(sims.sum())
        if total <= 0.0:
            return None
        v = sims @ self.x[:, m * E:(m + 1) * E]
        return (v + (PRIOR * total) * pm) / (total * (1.0 + PRIOR))
