"""The co-activation predictor: which experts the next layer will pick, learned online.

Learns from the access stream only (``observe``: one client's fetch, in request
order) and proposes keys for a layer the client has not fetched yet (``propose``).
Pure and deterministic: integer counts, no clock, I/O, threads or randomness, so
the same stream gives the same proposals (``k3d replay`` relies on it).

Model, per target layer ``m`` and expert ``e``:

- ``pop[m, e] / visits[m]``: how often ``e`` is picked when ``m`` is fetched;
- the *context* of a fetch of ``m``: the client's layers fetched at distance
  ``d`` = 1 .. ``depth`` before ``m`` in the same pass (token).  For the first
  layer of a pass (nothing before it in the token) the context is the end of the
  client's previous pass instead, at distance ``m + layers - layer``: the last
  layers of the previous token predict the first layer of the next;
- ``co[m, d, a, e] / seen[m, d, a]``: how often ``e`` followed expert ``a`` of the
  context layer at distance ``d``.  The context layers' choices are combined
  naive-Bayes style (a log-odds sum over ``d`` of the mean over that layer's
  picks, each shrunk towards ``pop`` by ``prior`` pseudo-counts), so a layer whose
  picks say nothing adds nothing;
- the raw score is then *calibrated*: its bin's measured hit frequency
  (``cal_hit / cal_n``; every candidate of every proposal that was not resident
  is resolved when its layer's fetch comes) replaces it.  A confidence is thus a
  measured frequency, not a model's belief: on a stream where the context carries
  no information every bin converges to the base rate and nothing clears
  ``min_prob``.

Counts are halved (floor) once a layer has ``window`` visits: old behaviour fades,
and every count stays an integer.

Cost: a handful of numpy operations per fetch, whatever the number of experts
(one gather of the context rows, one product, one log-odds sum, one lookup of the
calibration; see ``bench/policy_replay.py --cost``).  Per client it keeps only its
current and previous pass's last ``depth`` layers (``forget`` drops them).
``state``/``restore`` carry the counts across a restart (JSON-able, validated).
"""

from __future__ import annotations

import numpy as np

BINS = 20                               # calibration bins over the raw probability
CAL_PRIOR = 10.0                        # pseudo-candidates at the base rate in each bin
# bin i holds raw probabilities in [i / BINS, (i + 1) / BINS): the same edges as odds
EDGES = np.array([i / (BINS - i) for i in range(1, BINS)])


class CoPredictor:
    name = "coact"

    def __init__(self, layers: int = 1, experts: int = 1, depth: int = 4, prior: float = 2.0,
                 window: int = 4096, min_prob: float = 0.3):
        self.layers, self.experts = max(1, layers), max(1, experts)
        self.depth, self.prior, self.window, self.min_prob = depth, prior, window, min_prob
        self._alloc(self.layers, self.experts)
        self._set_cal(np.zeros(BINS, np.int64), np.zeros(BINS, np.int64))
        self._recent: dict[int, list] = {}      # client -> [(layer, picks)] of this pass, newest last
        self._prev: dict[int, list] = {}        # client -> the same for its previous pass
        self._pending: dict[int, tuple] = {}    # client -> (target layer, bins; BINS: not a candidate)
        self._k: dict[int, int] = {}            # client -> keys in its last fetch
        self._ctx: dict[int, tuple] = {}        # client -> (target layer, _context's answer)
        self._avg: dict[tuple, np.ndarray] = {} # context group sizes -> the matrix averaging each group
        self._keys: dict[int, list] = {}        # layer -> its keys, expert order

    def _alloc(self, L: int, E: int) -> None:
        """Zero counts for ``L`` x ``E``.  One int64 block per layer holds its ``pop`` (E),
        ``seen`` (R = depth * E rows, row (d - 1) * E + a) and ``co`` (R x E), so one
        fetch's counts move with one indexed add; the named arrays are views of it."""
        D = self.depth
        R = D * E
        self._B = B = E + R + R * E
        self._blk = np.zeros((L, B), np.int64)
        self._flat = self._blk.reshape(-1)
        self.visits = [0] * L
        self._ver = [0] * L                     # bumped whenever a layer's counts change
        self._pm: dict[int, list] = {}          # k -> _base_all(k), kept fresh by _base
        self.pop = self._blk[:, :E]
        self.seen = self._blk[:, E:E + R]
        self.co = self._blk[:, E + R:].reshape(L, R, E)
        self._rows = [(self.pop[m], self.seen[m], self.co[m]) for m in range(L)]

    def _set_cal(self, cal_n, cal_hit) -> None:
        """The calibration counts: one array (misses' bins, a discard bin, hits' bins, a
        discard bin) so one bincount moves both; ``cal_n`` / ``cal_hit`` are views."""
        self._cal = np.zeros(2 * BINS + 2, np.int64)
        self.cal_n, self.cal_hit = self._cal[:BINS], self._cal[BINS + 1:2 * BINS + 1]
        self.cal_n[:], self.cal_hit[:] = cal_n, cal_hit
        self._cal_div = self.cal_n + CAL_PRIOR

    # -- learning ---------------------------------------------------------------
    def observe(self, client: int, keys) -> None:
        """``client`` fetched ``keys`` (one layer's experts, or several layers')."""
        if not keys:
            return
        first = keys[0][0]
        if all(k[0] == first for k in keys):
            groups = {first: [e for _, e in keys]}
        else:
            groups = {}
            for layer, e in keys:
                groups.setdefault(layer, []).append(e)
        for layer, es in groups.items():
            top = max(es)
            if layer >= self.layers or top >= self.experts:
                self._grow(layer + 1, top + 1)
            self._observe_layer(client, layer, sorted(set(es)))
        self._k[client] = len(keys)

    def _observe_layer(self, client: int, m: int, picks: list[int]) -> None:
        arr = np.array(picks, np.int64)
        pend = self._pending.pop(client, None)
        if pend is not None and pend[0] == m:      # resolve the calibration of the last proposal
            pb = pend[1]                           # each expert's bin, BINS where not a candidate
            self._cal += np.bincount(np.concatenate((pb, pb.take(arr) + (BINS + 1))), minlength=2 * BINS + 2)
            self._cal_div = self.cal_n + CAL_PRIOR
        hist = self._recent.get(client)
        if hist and hist[-1][0] >= m:              # a new pass without end_pass (a new token)
            self.end_pass(client)
            hist = self._recent[client]
        ctx = self._context(client, m)
        self.visits[m] += 1
        self._ver[m] += 1
        at = arr + m * self._B                     # pop's entries
        if ctx is None:
            self._flat[at] += 1
        else:                                      # (distance, expert) rows, each once: picks are sets
            self._flat[np.concatenate((at, ctx[3] + m * self._B, (ctx[4] + at).ravel()))] += 1
        if self.visits[m] >= self.window:
            self.visits[m] //= 2
            self._blk[m] //= 2
        if hist is None:
            hist = self._recent[client] = []
        hist.append((m, picks))
        del hist[:-self.depth]
        self._ctx.pop(client, None)

    def end_pass(self, client: int) -> None:
        """``client``'s token ended: its next fetch begins a new pass, whose first layer
        takes this pass's last layers as context."""
        hist = self._recent.get(client)
        if hist:
            self._prev[client] = hist
            self._recent[client] = []
            self._ctx.pop(client, None)
            k = self._k.get(client, 1)
            k = min(max(1, k), self.experts - 1) if self.experts > 1 else 1
            self._pm[k] = self._base_all(k)        # the next pass reads every layer's rates

    def _context(self, client: int, m: int):
        """The client's context for layer ``m``: (rows of ``seen``/``co``, the matrix
        averaging over each context layer's picks, context layers, the rows' ``seen``
        and ``co`` offsets in a layer's block), or None.  Cached until the client's
        next fetch."""
        got = self._ctx.get(client)
        if got is not None and got[0] == m:
            return got[1]
        D, E = self.depth, self.experts
        hist = self._recent.get(client)
        if hist:
            parts = [(m - layer, picks) for layer, picks in hist]
        else:                                      # the pass's first layer: the previous pass's end
            parts = [(m + self.layers - layer, picks) for layer, picks in self._prev.get(client, ())]
        rows, sizes = [], []
        for d, picks in parts:
            if 1 <= d <= D:
                base = (d - 1) * E
                rows += [base + a for a in picks]
                sizes.append(len(picks))
        ctx = None
        if sizes:
            sizes = tuple(sizes)
            avg = self._avg.get(sizes)
            if avg is None:
                avg = np.zeros((len(sizes), sum(sizes)))
                start = 0
                for row, n in enumerate(sizes):
                    avg[row, start:start + n] = 1.0 / n
                    start += n
                self._avg[sizes] = avg
            idx = np.array(rows, np.int64)
            ctx = (idx, avg, len(sizes), idx + E, (idx * E + (E + D * E))[:, None])
        self._ctx[client] = (m, ctx)
        return ctx

    def forget(self, client: int) -> None:
        """``client`` left: its context goes (what it taught stays)."""
        for d in (self._recent, self._prev, self._pending, self._k, self._ctx):
            d.pop(client, None)

    # -- predicting ---------------------------------------------------------------
    def _base(self, m: int, k: int):
        """Layer ``m``'s plain pick rates for clients fetching ``k`` keys: (pm, prior * pm,
        CAL_PRIOR * pm, (1 - pm) / pm), rows of arrays cached per ``k`` and refreshed
        when the layer's counts change (all layers at once by ``end_pass``)."""
        c = self._pm.get(k)
        if c is None:
            c = self._pm[k] = self._base_all(k)
        elif c[0][m] != self._ver[m]:
            E = self.experts
            pm = (self.pop[m] + k / E) * (1.0 / (self.visits[m] + 1.0))
            c[1][m], c[2][m], c[3][m], c[4][m] = pm, self.prior * pm, CAL_PRIOR * pm, (1.0 - pm) / pm
            c[0][m] = self._ver[m]
        return c[1][m], c[2][m], c[3][m], c[4][m]

    def _base_all(self, k: int) -> list:
        # pop <= visits and k < E keep pm, and so every q in scores, strictly inside (0, 1)
        pm = (self.pop + k / self.experts) * (1.0 / (np.array(self.visits, np.float64) + 1.0))[:, None]
        return [list(self._ver), pm, self.prior * pm, CAL_PRIOR * pm, (1.0 - pm) / pm]

    def scores(self, client: int, m: int):
        """(odds that each expert of layer ``m`` is picked given the client's context,
        its plain pick rate times CAL_PRIOR)."""
        E = self.experts
        k = min(max(1, self._k.get(client, 1)), E - 1) if E > 1 else 1
        pm, ppm, cpm, io = self._base(m, k)
        ctx = self._context(client, m)
        if ctx is None:
            return 1.0 / io, cpm
        _, seen, co = self._rows[m]
        idx, avg, n = ctx[:3]
        # per context layer: mean over its picks a of (co[a, e] + prior * pm) / (seen[a] + prior)
        q = avg @ ((co.take(idx, 0) + ppm) / (seen.take(idx) + self.prior)[:, None])
        odds = (q / (1.0 - q)).prod(axis=0)        # naive Bayes: the layers' odds multiply ...
        if n > 1:                                  # ... over the prior odds, counted once
            odds *= io ** (n - 1)
        return odds, cpm

    def calibrated(self, odds, cpm):
        """(bins, confidence): each score's bin and that bin's measured hit rate,
        shrunk towards the expert's plain pick rate (``cpm``: times CAL_PRIOR) while the
        bin has few resolved candidates: a bin must show it beats the base rate before
        it is trusted."""
        bins = np.searchsorted(EDGES, odds, side="right")
        return bins, (self.cal_hit.take(bins) + cpm) / self._cal_div.take(bins)

    def propose(self, client: int, layer: int, budget: int, resident=()) -> list[tuple[tuple[int, int], float]]:
        """Up to ``budget`` keys of ``layer`` not in ``resident`` (a container of keys),
        with confidence at least ``min_prob``, best first (ties: lower expert), as
        (key, confidence).  Remembers the candidates so the client's fetch of
        ``layer`` measures the calibration."""
        if not 0 <= layer < self.layers or (client not in self._recent and client not in self._prev):
            return []
        bins, conf = self.calibrated(*self.scores(client, layer))
        # Calibrated on the candidates not resident only: those are the ones read ahead,
        # and being evicted already says something (a key the policy let go is picked
        # less often than its score's bin says on average).
        keys = self._keys.get(layer)
        if keys is None or len(keys) != self.experts:
            keys = self._keys[layer] = [(layer, e) for e in range(self.experts)]
        cand = np.array([k not in resident for k in keys], bool)
        self._pending[client] = (layer, np.where(cand, bins, BINS))
        if budget <= 0:
            return []
        conf *= cand
        if conf.max() < self.min_prob:
            return []
        ok = np.flatnonzero(conf >= self.min_prob)
        best = ok[np.argsort(-conf[ok], kind="stable")[:budget]]
        return [(keys[e], float(conf[e])) for e in best.tolist()]

    def next_layer(self, client: int) -> int | None:
        """The first layer after ``client``'s last fetch in this pass that has been
        fetched before (a model may have dense layers between its MoE layers); None:
        none yet, or the last fetch was the last such layer (the next one is in the
        next token: ``first_layer``)."""
        hist = self._recent.get(client)
        if not hist:
            return None
        v = self.visits
        for m in range(hist[-1][0] + 1, self.layers):
            if v[m]:
                return m
        return None

    def first_layer(self, client: int) -> int | None:
        """The layer ``client``'s next pass begins with (the lowest ever fetched), when
        its current pass is over (``end_pass``) and it has one before; else None."""
        if self._recent.get(client) or not self._prev.get(client):
            return None
        v = self.visits
        return next((m for m in range(self.layers) if v[m]), None)

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
        return list({**self._recent, **self._prev})

    # -- shape and warm restart ------------------------------------------------------
    def _grow(self, layers: int, experts: int) -> None:
        L, E = max(layers, self.layers), max(experts, self.experts)
        if (L, E) == (self.layers, self.experts):
            return
        old = self._views()
        self.layers, self.experts = L, E
        self._alloc(L, E)
        new = self._views()
        for name, arr in old.items():
            new[name][tuple(slice(0, n) for n in arr.shape)] = arr
        self.visits = new["visits"].tolist()
        self._ctx.clear()                          # row numbers depend on the expert count
        self._pending.clear()
        self._keys.clear()

    def _views(self) -> dict:
        """The counts in their saved shapes: visits (L,), pop (L, E), seen (L, D, E), co (L, D, E, E)."""
        L, D, E = self.layers, self.depth, self.experts
        return {"visits": np.array(self.visits, np.int64), "pop": self.pop,
                "seen": self.seen.reshape(L, D, E), "co": self.co.reshape(L, D, E, E)}

    def state(self) -> dict:
        """The learned counts, JSON-able (sparse: nonzero entries only)."""
        def sparse(arr):
            idx = np.nonzero(arr)
            return [[*map(int, i), int(arr[i])] for i in zip(*idx)]
        return {"predictor": self.name, "layers": self.layers, "experts": self.experts, "depth": self.depth,
                **{name: sparse(arr) for name, arr in self._views().items()},
                "cal_n": [int(x) for x in self.cal_n], "cal_hit": [int(x) for x in self.cal_hit]}

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
            views = new._views()
            for name, arr in views.items():
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
        new.visits = views["visits"].tolist()
        new._set_cal(cal_n, cal_hit)
        for name in ("layers", "experts", "visits", "pop", "seen", "co", "_B", "_blk", "_flat", "_rows",
                     "_ver", "_pm", "_cal", "cal_n", "cal_hit", "_cal_div"):
            setattr(self, name, getattr(new, name))
        self._ctx.clear()
        self._pending.clear()
        self._keys.clear()
