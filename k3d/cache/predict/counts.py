"""The co-activation predictor's integer counts, learned in batches, and what scoring reads of them.

``Counts`` holds, for a model of ``layers`` x ``experts`` and a context ``depth``:

- ``visits[m]``: fetches of layer ``m``; ``pop[m, e]``: those that picked ``e``;
- ``seen[m, r]`` / ``co[m, r, e]``: fetches of ``m`` whose context held row ``r``
  (``r = (d - 1) * experts + a``: expert ``a`` of the layer ``d`` before), and those of
  them that picked ``e``;
- ``cal_n[b]`` / ``cal_hit[b]``: candidates whose raw score fell in bin ``b``, and those
  of them picked when their layer came.

Learning only appends to buffers (``learn``: a fetch's (layer, context rows, picks);
``cal_idx`` / ``cal_arrs``: calibration indices, as a list or as arrays; ``cal_vecs``:
calibration counts already binned and weighted, ``CoPredictor``'s sampled deferred
candidates): the arrays
move at ``fold``, all at once, so a fetch pays for a tuple and a few list appends
instead of a few numpy calls, and everything read from the counts (``Tables``)
stays fixed between folds and is computed once per fold.  The owner
decides when to fold; any schedule that is a function of the stream keeps the
predictor deterministic.

Memory: the counts are int16 (``DTYPE``), one block of ``E + D * E + D * E * E``
per layer: ``2 * L * (E + D * E + D * E**2)`` bytes, about ``2 * D * L * E**2``
(``nbytes``); int16 holds them because a fold halves every layer that reached
``window`` (at most ``MAX_WINDOW``) and one fold adds at most ``MAX_ADD`` to a count.

Invariants (between folds and after one): every count is a non-negative integer;
``pop[m] <= visits[m]``, ``co[m, r] <= seen[m, r] <= visits[m]``; ``cal_hit <= cal_n``;
after a fold every ``visits[m] < window`` (a layer that reaches it has all its counts
halved, floor, so old behaviour fades and counts stay integers).  ``snapshot`` gives
the folded counts without folding (a warm-restart save must not change what the
daemon predicts next: replay has no such save).
"""

from __future__ import annotations

import numpy as np

BINS = 20                               # calibration bins over the raw probability
CAL_PRIOR = 10.0                        # pseudo-candidates at the base rate in each bin
HIT = BINS + 1                          # a picked candidate's offset in the calibration buffer
BIG = 1 << 16                           # counts above which a long fold counts by layer
DTYPE = np.int16                        # the counts' type (calibration and visits: int64)
MAX_WINDOW = 8192                       # the largest window: a count is below it after a fold ...
MAX_ADD = 16384                         # ... and a fold adds at most this many fetches (its owner's bound)


def nbytes(layers: int, experts: int, depth: int) -> int:
    """The counts' bytes for a model of ``layers`` x ``experts`` and a context ``depth``."""
    E = experts
    return np.dtype(DTYPE).itemsize * layers * (E + depth * E + depth * E * E)


DEPTH = 4               # context layers, where the counts fit in COUNTS_BYTES
COUNTS_BYTES = 16 << 20  # the counts' memory, above which the context is shallower (down to 1 layer)


def depth_for(layers: int, experts: int) -> int:
    """The context depth for a model of ``layers`` x ``experts``: ``DEPTH``, or as many
    layers as keep the counts (``counts.nbytes``, ~2 * depth * L * E**2 bytes) within
    ``COUNTS_BYTES``, at least 1.  So the counts take at most
    max(COUNTS_BYTES, 2 * L * (E**2 + 2 * E)) bytes: 6.3 MB at Qwen3-30B's 48 x 128
    (depth 4), 15.3 MB at DeepSeek-V3's 58 x 256 (depth 2), 18.1 MB at Kimi-K2's
    61 x 384 (depth 1)."""
    return max(1, min(DEPTH, COUNTS_BYTES // nbytes(layers, experts, 1)))


class Counts:
    def __init__(self, layers: int, experts: int, depth: int, window: int):
        if not 0 < window <= MAX_WINDOW:
            raise ValueError(f"window {window}: 1 to {MAX_WINDOW} (the counts are {np.dtype(DTYPE).name})")
        self.layers, self.experts, self.depth, self.window = layers, experts, depth, window
        E, R = experts, depth * experts
        self.B = B = E + R + R * E              # one layer's block: pop (E), seen (R), co (R x E)
        self.blk = np.zeros((layers, B), DTYPE)
        self.flat = self.blk.reshape(-1)
        self.visits = np.zeros(layers, np.int64)
        self.pop = self.blk[:, :E]
        self.seen = self.blk[:, E:E + R]
        self.co = self.blk[:, E + R:].reshape(layers, R, E)
        # calibration: misses' bins, a discard bin, hits' bins, a discard bin (one bincount moves both)
        self.cal = np.zeros(2 * BINS + 2, np.int64)
        self.cal_n, self.cal_hit = self.cal[:BINS], self.cal[HIT:HIT + BINS]
        self.version = 0                        # bumped by every fold that changed something
        self._clear()

    def _clear(self) -> None:
        # (context rows, picks) sizes -> [(layer, *rows, *picks)] of the fetches learned
        self.fetches: dict[tuple, list] = {}
        self.n = 0                              # fetches learned since the last fold
        self.cal_idx: list[int] = []            # calibration buffer indices (bin, or HIT + bin)
        self.cal_arrs: list[np.ndarray] = []
        self.cal_vecs: list[np.ndarray] = []    # (2 * BINS + 2,) count vectors, added as they are

    def learn(self, m: int, rows, picks: tuple) -> None:
        """A fetch of layer ``m`` picked ``picks`` (distinct) with context ``rows`` (distinct)."""
        self.n += 1
        got = self.fetches.get((len(rows), len(picks)))
        if got is None:
            got = self.fetches[(len(rows), len(picks))] = []
        got.append((m, *rows, *picks))

    def pending(self) -> int:
        """Fetches learned since the last fold."""
        return self.n

    # -- folding ------------------------------------------------------------------
    def fold(self) -> None:
        """Move the buffers into the counts (and halve the layers that reached ``window``)."""
        if not (self.n or self.cal_idx or self.cal_arrs or self.cal_vecs):
            return
        self._apply(self.flat, self.visits, self.cal)
        self._clear()
        self.version += 1

    def _apply(self, flat, visits, cal) -> None:
        # Every index of one shape of fetch at once: pop (m, e), seen (m, r), co (m, r, e);
        # counted with one bincount over all the counts when the fold is long, else by
        # sorting.  A long fold of a large model counts a layer at a time instead
        # (_apply_layers): a temporary the size of all the counts would cost a page
        # fault per 4 KiB at every fold, more than the counting itself.
        E, R = self.experts, self.depth * self.experts
        total = sum(len(got) * (k + nr + nr * k) for (nr, k), got in self.fetches.items())
        if flat.size <= 16 * total and flat.size > BIG:
            self._apply_layers(flat, visits)
        elif total:
            parts, layers = [], []
            for (nr, _), got in self.fetches.items():
                a = np.array(got, np.int64)
                m, rows, picks = a[:, 0], a[:, 1:1 + nr], a[:, 1 + nr:]
                base = (m * self.B)[:, None]
                parts += [(base + picks).ravel(), (base + E + rows).ravel(),
                          ((base + E + R)[:, :, None] + rows[:, :, None] * E + picks[:, None, :]).ravel()]
                layers.append(m)
            idx = np.concatenate(parts)
            if flat.size <= 16 * idx.size:         # a dense count is cheaper than sorting
                flat += np.bincount(idx, minlength=flat.size)
            else:
                u, n = np.unique(idx, return_counts=True)
                flat[u] += n
            visits += np.bincount(np.concatenate(layers), minlength=len(visits))
        if total:
            blk = flat.reshape(len(visits), -1)
            while (over := np.flatnonzero(visits >= self.window)).size:
                visits[over] //= 2
                blk[over] //= 2
        cparts = self.cal_arrs + ([np.array(self.cal_idx, np.int64)] if self.cal_idx else [])
        if cparts:
            cal += np.bincount(np.concatenate(cparts), minlength=2 * BINS + 2)
        for v in self.cal_vecs:
            cal += v

    def _apply_layers(self, flat, visits) -> None:
        """``_apply``'s counts, a layer at a time (the fetches sorted by layer): in a
        layer's block, pop (e), seen (E + r), co (E + R + r * E + e)."""
        E, R, B = self.experts, self.depth * self.experts, self.B
        blk = flat.reshape(len(visits), B)
        layers = []
        for (nr, _), got in self.fetches.items():
            a = np.array(got, np.int64)
            a = a[np.argsort(a[:, 0], kind="stable")]
            m, rows, picks = a[:, 0], a[:, 1:1 + nr], a[:, 1 + nr:]
            cuts = (np.flatnonzero(np.diff(m)) + 1).tolist()
            ml = m.tolist()
            for lo, hi in zip([0, *cuts], [*cuts, len(ml)]):
                r, pk = rows[lo:hi], picks[lo:hi]
                seg = np.concatenate((pk.ravel(), (r + E).ravel(),
                                      ((E + R) + r[:, :, None] * E + pk[:, None, :]).ravel()))
                if B <= 16 * seg.size:             # a dense count is cheaper than sorting
                    blk[ml[lo]] += np.bincount(seg, minlength=B)
                else:
                    u, n = np.unique(seg, return_counts=True)
                    blk[ml[lo], u] += n
            layers.append(m)
        visits += np.bincount(np.concatenate(layers), minlength=len(visits))

    def snapshot(self, cal_extra=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(blk, visits, cal) as a fold would leave them, without folding (``cal_extra``:
        a calibration count vector the fold would add too)."""
        blk, visits, cal = self.blk.copy(), self.visits.copy(), self.cal.copy()
        self._apply(blk.reshape(-1), visits, cal)
        if cal_extra is not None:
            cal += cal_extra
        return blk, visits, cal

    def views(self, blk=None, visits=None) -> dict:
        """The counts in their saved shapes: visits (L,), pop (L, E), seen (L, D, E), co (L, D, E, E)."""
        blk = self.blk if blk is None else blk
        L, D, E = self.layers, self.depth, self.experts
        R = D * E
        return {"visits": self.visits if visits is None else visits, "pop": blk[:, :E],
                "seen": blk[:, E:E + R].reshape(L, D, E), "co": blk[:, E + R:].reshape(L, D, E, E)}

    def take(self, other: Counts) -> None:
        """Copy ``other``'s folded counts (no larger than ours) into ours (zeros elsewhere)."""
        mine, theirs = self.views(), other.views()
        for name, arr in theirs.items():
            mine[name][tuple(slice(0, n) for n in arr.shape)] = arr
        self.cal[:] = other.cal
        self.version += 1


class Tables:
    """What scoring reads, for clients whose fetches hold ``k`` keys, computed from one
    fold of ``Counts`` (``version``) and valid until the next:

    - ``pm[m, e] = (pop + k / E) / (visits + 1)``: the plain pick rate, strictly inside
      (0, 1) (``pop <= visits`` and ``0 < k < E``), so every odds below is finite;
    - ``ppm = prior * pm``; ``io = (1 - pm) / pm``;
    - ``ct[m, b, e] = (cal_hit[b] + CAL_PRIOR * pm[m, e]) / (cal_n[b] + CAL_PRIOR)``: the
      calibrated confidence of expert ``e`` of layer ``m`` whose raw score fell in bin
      ``b``, shrunk towards the plain rate while the bin has few resolved candidates;
    - ``top[m, e]``: the best confidence any bin gives expert ``e`` of layer ``m``, and
      ``order(m)`` the (top, expert) pairs best first: no candidate of a proposal can
      have a confidence above the first one not resident, whatever the context
      (``best_l[m]``: the first one, resident or not);
    - ``q``: kept q rows per layer (``score.layer_q``: dense models' scoring, and any
      model's fold); dense models: ``ct_dense``, per layer; small models:
      ``sets`` and ``memo``, the context layers' odds factors (``score.factors``),
      ``ct`` and ``1 / io`` as lists (``ct_l``, ``inv_io_l``).
    """

    def __init__(self, counts: Counts, k: int, prior: float, small: bool, min_prob: float):
        c = counts
        self.version = c.version
        E = c.experts
        pm = (c.pop + k / E) * (1.0 / (c.visits.astype(np.float64) + 1.0))[:, None]
        self.pm, self.ppm = pm, prior * pm
        self.pm_mix: np.ndarray | None = None    # score.mix's share of pm, made at its first use
        self.io = (1.0 - pm) / pm
        ct = (c.cal_hit[None, :, None] + CAL_PRIOR * pm[:, None, :]) / (c.cal_n + CAL_PRIOR)[None, :, None]
        self.ct = ct.reshape(c.layers, BINS * E)
        self.ar = np.arange(E)
        self.top = ct.max(axis=1)                                      # (L, E)
        self.best_l = self.top.max(axis=1).tolist()                    # (L,): no proposal's can be above
        self._order: dict[int, list] = {}
        self._sorted: np.ndarray | None = None  # (L, E): each layer's experts by top, best first
        self.small = small
        self.q: dict[int, np.ndarray] = {}      # layer -> score.layer_q (its rows of qall)
        self.qall: np.ndarray | None = None     # (L, D * E, E): score.layer_q's buffer
        self._ct_dense: dict[int, np.ndarray] = {}
        if small:                               # plain lists: cheaper than numpy calls for a few experts
            self.sets: dict[int, tuple] = {}    # picks size -> score.set_table
            self.memo: dict[tuple, list] = {}   # (layer, distance, picks) -> score.factors
            self.ct_l = self.ct.tolist()       # one call: cheaper than a layer at a time
            self.inv_io_l = (pm / (1.0 - pm)).tolist()

    def ct_dense(self, m: int) -> np.ndarray:
        """``ct[m]`` with a bin ``BINS`` of -1 (a resident expert's: never a candidate), made
        at the layer's first use in the fold (all layers at once: a copy of megabytes per
        fold for the largest models, whose folds are the most frequent)."""
        got = self._ct_dense.get(m)
        if got is None:
            got = self._ct_dense[m] = np.concatenate((self.ct[m], np.full(len(self.ar), -1.0)))
        return got

    def order(self, m: int) -> list:
        """Layer ``m``'s (top, expert) pairs, best first (ties: lower expert); one numpy sort of
        every layer's per fold, not one per layer."""
        got = self._order.get(m)
        if got is None:
            if self._sorted is None:                   # every layer at once: one sort per fold
                self._sorted = np.argsort(-self.top, axis=1, kind="stable")   # (equal tops: expert order)
            idx = self._sorted[m]
            got = self._order[m] = list(zip(self.top[m][idx].tolist(), idx.tolist()))
        return got
