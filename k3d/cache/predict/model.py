"""The co-activation predictor: which experts the next layer will pick, learned online.

Learns from the access stream only (``observe``: one client's fetch, in request
order) and proposes keys for the layer after the one just fetched (``propose``).
Pure and deterministic: integer counts in numpy arrays, no clock, I/O, threads or
randomness, so the same stream gives the same proposals (``k3d replay`` relies on it).

Model, per target layer ``m`` and expert ``e``:

- ``pop[m, e] / visits[m]``: how often ``e`` is picked when ``m`` is fetched;
- for each of the ``depth`` layers fetched just before ``m`` in the same pass
  (distance ``d`` = 1, 2, ...): ``co[m, d, a, e] / seen[m, d, a]``, how often ``e``
  followed expert ``a`` of the layer ``d`` steps back.  The context layers' choices
  are combined naive-Bayes style (a log-odds sum over ``d`` of the mean over that
  layer's picks, each shrunk towards ``pop`` by ``prior`` pseudo-counts), so a
  layer whose picks say nothing adds nothing;
- the raw score is then *calibrated*: its bin's measured hit frequency (``cal_hit /
  cal_n``; every candidate of every proposal that was not resident is resolved
  when its layer's fetch comes) replaces it.  A confidence is thus a measured frequency, not a model's
  belief: on a stream where the context carries no information every bin converges
  to the base rate and nothing clears ``min_prob``.

Counts are halved (floor) once a layer has ``window`` visits: old behaviour fades,
and every count stays an integer.

Per client it keeps only the last ``depth`` fetched layers (``forget`` drops them).
``state``/``restore`` carry the counts across a restart (JSON-able, validated).
"""

from __future__ import annotations

import numpy as np

BINS = 20                               # calibration bins over the raw probability
CAL_PRIOR = 10.0                        # pseudo-candidates at the base rate in each bin


class CoPredictor:
    name = "coact"

    def __init__(self, layers: int = 1, experts: int = 1, depth: int = 4, prior: float = 2.0,
                 window: int = 4096, min_prob: float = 0.3):
        self.layers, self.experts = max(1, layers), max(1, experts)
        self.depth, self.prior, self.window, self.min_prob = depth, prior, window, min_prob
        L, D, E = self.layers, depth, self.experts
        self.visits = np.zeros(L, np.int64)
        self.pop = np.zeros((L, E), np.int64)
        self.seen = np.zeros((L, D, E), np.int64)
        self.co = np.zeros((L, D, E, E), np.int64)
        self.cal_n = np.zeros(BINS, np.int64)
        self.cal_hit = np.zeros(BINS, np.int64)
        self._recent: dict[int, list] = {}      # client -> [(layer, experts array)], newest last
        self._pending: dict[int, tuple] = {}    # client -> (target layer, bins of its candidates)
        self._k: dict[int, int] = {}            # client -> keys in its last fetch
        self._ctx: dict[int, tuple] = {}        # client -> (target layer, _context's arrays)

    # -- learning ---------------------------------------------------------------
    def observe(self, client: int, keys) -> None:
        """``client`` fetched ``keys`` (one layer's experts, or several layers')."""
        by_layer: dict[int, list[int]] = {}
        for layer, e in keys:
            by_layer.setdefault(layer, []).append(e)
        for layer, es in by_layer.items():
            self._grow(layer + 1, max(es) + 1)
            self._observe_layer(client, layer, np.array(sorted(set(es)), np.int64))
        self._k[client] = len(keys)

    def _observe_layer(self, client: int, m: int, picks) -> None:
        pend = self._pending.pop(client, None)
        if pend is not None and pend[0] == m:      # resolve the calibration of the last proposal
            _, bins, cand = pend
            self.cal_n += np.bincount(bins[cand], minlength=BINS)
            self.cal_hit += np.bincount(bins[picks[cand[picks]]], minlength=BINS)
        ctx = self._context(client, m)
        self.visits[m] += 1
        self.pop[m, picks] += 1
        if ctx is not None:
            di, ai, _ = ctx                        # (distance, expert) pairs, each once: picks are sets
            self.seen[m][di, ai] += 1
            self.co[m][di[:, None], ai[:, None], picks] += 1
        if self.visits[m] >= self.window:
            for arr in (self.visits[m:m + 1], self.pop[m], self.seen[m], self.co[m]):
                arr //= 2
        hist = self._recent.setdefault(client, [])
        if hist and hist[-1][0] >= m:              # a new pass of the cycle (a new token)
            hist.clear()
        hist.append((m, picks))
        del hist[:-self.depth]
        self._ctx.pop(client, None)

    def _context(self, client: int, m: int):
        """The client's recent layers before ``m`` in this pass, as index arrays: distance
        - 1 and expert per pick, and the matrix that averages over each layer's picks
        (one row per context layer).  None: no context.  Cached until the client's next fetch."""
        got = self._ctx.get(client)
        if got is not None and got[0] == m:
            return got[1]
        di, ai, groups = [], [], []
        for layer, picks in self._recent.get(client, ()):
            d = m - layer
            if 1 <= d <= self.depth:
                groups.append((len(ai), len(picks)))
                di += [d - 1] * len(picks)
                ai += picks.tolist()
        ctx = None
        if groups:
            avg = np.zeros((len(groups), len(ai)))
            for row, (start, n) in enumerate(groups):
                avg[row, start:start + n] = 1.0 / n
            ctx = (np.array(di, np.int64), np.array(ai, np.int64), avg)
        self._ctx[client] = (m, ctx)
        return ctx

    def forget(self, client: int) -> None:
        """``client`` left: its context goes (what it taught stays)."""
        self._recent.pop(client, None)
        self._pending.pop(client, None)
        self._k.pop(client, None)
        self._ctx.pop(client, None)

    # -- predicting ---------------------------------------------------------------
    def scores(self, client: int, m: int):
        """(raw probability that each expert of layer ``m`` is picked given the client's
        context, its plain pick rate)."""
        E = self.experts
        v = int(self.visits[m])
        k = min(max(1, self._k.get(client, 1)), E - 1) if E > 1 else 1
        # pop <= visits and k < E keep pm, and so every q below, strictly inside (0, 1)
        pm = (self.pop[m] + k / E) / (v + 1.0)
        base = np.log(pm / (1 - pm))
        ctx = self._context(client, m)
        if ctx is None:
            return pm, pm
        di, ai, avg = ctx
        # per context layer: mean over its picks a of (co[a, e] + prior * pm) / (seen[a] + prior)
        w = 1.0 / (self.seen[m][di, ai] + self.prior)
        q = avg @ (self.co[m][di, ai] * w[:, None]) + (self.prior * (avg @ w))[:, None] * pm
        z = np.log(q / (1 - q)).sum(axis=0) - (len(avg) - 1) * base
        return 1.0 / (1.0 + np.exp(-z)), pm

    def calibrated(self, raw, base):
        """(bins, confidence): each raw score's bin and that bin's measured hit rate,
        shrunk towards ``base`` (the expert's plain pick rate) while the bin has few
        resolved candidates: a bin must show it beats the base rate before it is trusted."""
        bins = np.minimum((raw * BINS).astype(np.int64), BINS - 1)
        n, h = self.cal_n[bins], self.cal_hit[bins]
        return bins, (h + CAL_PRIOR * base) / (n + CAL_PRIOR)

    def propose(self, client: int, layer: int, budget: int, resident) -> list[tuple[tuple[int, int], float]]:
        """Up to ``budget`` keys of ``layer`` not ``resident(key)``, with confidence at least
        ``min_prob``, best first, as (key, confidence).  Remembers the candidates so the
        client's fetch of ``layer`` measures the calibration."""
        if not 0 <= layer < self.layers or client not in self._recent:
            return []
        raw, base = self.scores(client, layer)
        bins, conf = self.calibrated(raw, base)
        # Calibrated on the candidates not resident only: those are the ones read ahead,
        # and being evicted already says something (a key the policy let go is picked
        # less often than its score's bin says on average).
        cand = np.array([not resident((layer, e)) for e in range(self.experts)], bool)
        self._pending[client] = (layer, bins, cand)
        if budget <= 0:
            return []
        order = np.argsort(-conf, kind="stable")                   # best first; ties: lower expert
        out = []
        for e in order:
            c = float(conf[e])
            if c < self.min_prob:
                break
            if cand[e]:
                out.append(((layer, int(e)), c))
                if len(out) >= budget:
                    break
        return out

    def next_layer(self, client: int) -> int | None:
        """The first layer after ``client``'s last fetch that has been fetched before (a
        model may have dense layers between its MoE layers); None: none yet, or the
        last fetch was the last such layer (the next one is in the next token)."""
        hist = self._recent.get(client)
        if not hist:
            return None
        later = np.flatnonzero(self.visits[hist[-1][0] + 1:])
        return None if not len(later) else hist[-1][0] + 1 + int(later[0])

    def remaining(self, client: int) -> int:
        """Keys ``client``'s current pass still needs (layers after its last, times its
        last fetch's size): what a prediction must leave room for."""
        hist = self._recent.get(client)
        if not hist:
            return 0
        return (self.layers - 1 - hist[-1][0]) * self._k.get(client, 0)

    def clients(self):
        return list(self._recent)

    # -- shape and warm restart ------------------------------------------------------
    def _grow(self, layers: int, experts: int) -> None:
        L, E = max(layers, self.layers), max(experts, self.experts)
        if (L, E) == (self.layers, self.experts):
            return
        D, ol, oe = self.depth, self.layers, self.experts

        def grown(arr, shape):
            out = np.zeros(shape, np.int64)
            out[tuple(slice(0, s) for s in arr.shape)] = arr
            return out
        self.visits = grown(self.visits, (L,))
        self.pop = grown(self.pop, (L, E))
        self.seen = grown(self.seen, (L, D, E))
        self.co = grown(self.co, (L, D, E, E))
        self.layers, self.experts = L, E
        del ol, oe

    def state(self) -> dict:
        """The learned counts, JSON-able (sparse: nonzero entries only)."""
        def sparse(arr):
            idx = np.nonzero(arr)
            return [[*map(int, i), int(arr[i])] for i in zip(*idx)]
        return {"predictor": self.name, "layers": self.layers, "experts": self.experts, "depth": self.depth,
                "visits": sparse(self.visits), "pop": sparse(self.pop), "seen": sparse(self.seen),
                "co": sparse(self.co), "cal_n": [int(x) for x in self.cal_n],
                "cal_hit": [int(x) for x in self.cal_hit]}

    def restore(self, state: dict) -> None:
        """Take saved counts; ValueError (nothing changed) if malformed or of another shape."""
        try:
            if state.get("predictor") != self.name or int(state["depth"]) != self.depth:
                raise ValueError("saved by another predictor or depth")
            L, E = int(state["layers"]), int(state["experts"])
            if not (0 < L <= 4096 and 0 < E <= 4096):
                raise ValueError("shape out of range")
            new = CoPredictor(max(L, self.layers), max(E, self.experts), self.depth, self.prior,
                              self.window, self.min_prob)
            for name in ("visits", "pop", "seen", "co"):
                arr = getattr(new, name)
                for row in state[name]:
                    *idx, val = (int(x) for x in row)
                    if val < 0 or len(idx) != arr.ndim or any(not 0 <= i < s for i, s in zip(idx, arr.shape)):
                        raise ValueError(f"{name} entry out of range")
                    arr[tuple(idx)] = val
            cal_n = np.array([int(x) for x in state["cal_n"]], np.int64)
            cal_hit = np.array([int(x) for x in state["cal_hit"]], np.int64)
            if cal_n.shape != (BINS,) or cal_hit.shape != (BINS,) or (cal_hit < 0).any() or (cal_hit > cal_n).any():
                raise ValueError("calibration out of range")
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"malformed predictor state: {e}") from None
        new.cal_n, new.cal_hit = cal_n, cal_hit
        for name in ("layers", "experts", "visits", "pop", "seen", "co", "cal_n", "cal_hit"):
            setattr(self, name, getattr(new, name))
