"""The co-activation predictor: which experts the next layer will pick, learned online.

Learns from the access stream only (``observe``: one client's fetch, in request
order) and proposes keys for a layer the client has not fetched yet (``propose``).
Pure and deterministic: integer counts, no clock, I/O, threads or randomness, so
the same stream gives the same proposals (``k3d replay`` relies on it).

Model, per target layer ``m`` and expert ``e`` (the counts: ``counts.Counts``):

- ``pop[m, e] / visits[m]``: how often ``e`` is picked when ``m`` is fetched;
- the *context* of a fetch of ``m``: the client's layers fetched at distance
  ``d`` = 1 .. ``depth`` before ``m`` in the same pass (token).  For the first
  layer of a pass (nothing before it in the token) the context is the end of the
  client's previous pass instead, at distance ``m + layers - layer``: the last
  layers of the previous token predict the first layer of the next;
- ``co[m, d, a, e] / seen[m, d, a]``: how often ``e`` followed expert ``a`` of the
  context layer at distance ``d``.  The context layers' choices are combined
  naive-Bayes style (a product of odds over ``d`` of the mean over that layer's
  picks, each shrunk towards ``pop`` by ``prior`` pseudo-counts), so a layer whose
  picks say nothing adds nothing.  The product is *tempered*: the layer at
  distance ``d`` counts with the exponent ``temper ** (d - 1)`` (``TEMPER``), as
  neighbouring layers' picks are not independent evidence (the hidden state
  carries over) and naive Bayes would count what they share once per layer; on
  the Qwen3 and Mixtral traces this ranks the candidates better (bench/README.md,
  the predictor's lab note);
- for models of more than ``score.SMALL`` experts, *recall* (``recall.Recall``): the
  last passes kept whole, those whose layers before ``m`` overlap this pass's most
  voting for ``m``'s experts; its votes and the naive-Bayes probability are mixed
  (``score.mix``) into the raw score.  Pairs cannot tell which of two paths through
  a layer a token is on, a whole pass can (bench/README.md, "recall");
- the raw score is then *calibrated*: its bin's measured hit frequency
  (``cal_hit / cal_n``; every candidate of every proposal that was not resident
  is resolved when its layer's fetch comes) replaces it.  A confidence is thus a
  measured frequency, not a model's belief: on a stream where the context carries
  no information every bin converges to the base rate and nothing clears
  ``min_prob``.

Learning is batched (``counts.Counts``): a fetch appends (layer, context rows,
picks) to a buffer, and the counts move at a *fold*, once ``_fold_at`` fetches were
learned since the last (a share ``1 / FOLD_SHARE`` of all learned so far, between
``MIN_FOLD`` and ``MAX_FOLD``): what was learned reaches the proposals at most that
many fetches late, a small share of what they already rest on.  Between folds
every table scoring reads is fixed (``counts.Tables``), so it is computed once per
fold, not per fetch: for models of up to ``SMALL`` experts, every context layer's
odds factors at once, and a fetch's scoring is list arithmetic over its experts
(``score.small``); larger ones take one numpy gather per fetch (``score.dense``).
The calibration's resolved candidates are buffered the same way, and a proposal
that cannot propose anything (no candidate reaches ``min_prob`` in any bin under
this fold's tables), or above ``SMALL`` experts nothing the caller would take (none
reaches its ``floor``, or its budget is 0), is not scored at all then: its
candidates' bins are computed at the fold, all together (``score.resolve``), with
the same counts, for one such proposal in ``cal_every`` (a count of them: the
others leave nothing; ``CAL_EVERY``, or ``CAL_EVERY_DENSE`` where recall votes for
each sample too), weighing ``cal_every`` (``_defer``); one that the layer's
tables alone say can give nothing reads neither the residency nor the caller's
``room``.  The fold
schedule is a function of the stream alone, so the daemon and ``k3d replay`` fold
at the same fetches.  Cost: see ``bench/policy_replay.py --cost``.

Memory, bounded by the model's layers ``L`` x experts ``E``: the counts take
``counts.nbytes`` (int16, ~2 * depth * L * E**2 bytes), with the depth from
``counts.depth_for`` so at most max(16 MiB, 2 * L * (E**2 + 2 * E)) bytes; a fold's
scoring tables ~400 * L * E bytes per fetch size in use (``counts.Tables``); the
float64 q rows (8 * depth * L * E**2) only while they fit in ``score.Q_BYTES``
(32 MiB); recall's passes (``recall.window_for``: at most max(4 MiB, 64 * L * E)
bytes); per client, a few passes' picks.  At DeepSeek-V3's 58 x 256: ~25 MB.

Per client it keeps only its current and previous pass's last ``depth`` layers
(``forget`` drops them).  ``state``/``restore`` carry the counts across a restart
(JSON-able, validated; ``state`` reports the counts as folded, without folding);
recall's passes are not carried (what the requests of the day did).

Thread: one caller at a time (the daemon's server thread, or replay); scoring
reuses buffers it owns (``scratch``), so one predictor is never shared between
threads.
"""

from __future__ import annotations

import numpy as np

from k3d.cache.predict import saved
from k3d.cache.predict.counts import BINS, HIT, Counts, Tables, depth_for
from k3d.cache.predict.recall import Recall
from k3d.cache.predict.score import SMALL, VOTES, bins_of, dense, resolve, small
from k3d.cache.resident import residency

from .passes import Passes

MIN_FOLD, FOLD_SHARE, MAX_FOLD = 32, 16, 1024
TEMPER = 0.7            # a context layer at distance d weighs TEMPER ** (d - 1) in the naive Bayes product


CAL_EVERY = 2           # a deferred proposal's candidates feed the calibration one in this many, weighted so
CAL_EVERY_DENSE = 4     # ... above SMALL experts, where each such sample also costs recall's vote


class CoPredictor(Passes):     # (Passes: where each client's pass stands, passes.py)
    name = "coact"

    def __init__(self, layers: int = 1, experts: int = 1, depth: int | None = None, prior: float = 2.0,
                 window: int = 4096, min_prob: float = 0.3, cal_every: int | None = None,
                 temper: float = TEMPER):
        self.layers, self.experts = max(1, layers), max(1, experts)
        depth = depth_for(self.layers, self.experts) if depth is None else depth
        self.depth, self.prior, self.window, self.min_prob = depth, prior, window, min_prob
        if cal_every is None:
            cal_every = CAL_EVERY if self.experts <= SMALL else CAL_EVERY_DENSE
        self.cal_every = max(1, cal_every)
        self.weights = [temper ** d for d in range(depth)]   # distance d + 1's exponent (score.py)
        self.weights_v = np.array(self.weights)
        self._deferrals = 0                     # proposals deferred (_defer), ever
        self.c = Counts(self.layers, self.experts, depth, window)
        self.learned = 0                        # fetches folded into the counts, ever
        self._fold_at = MIN_FOLD                # fold once this many fetches were learned since the last
        self._fetched = [False] * self.layers   # layers ever fetched (live, not folded)
        # passes that ended at a layer / went on past it: next_layer proposes only where
        # passes usually go on (a prediction is released at its token's end, unused)
        self._ends = [0] * self.layers
        self._goes = [0] * self.layers
        self._starts: dict[int, tuple] = {}     # client -> (its last pass's first layer, the one before's)
        self._tables: dict[int, Tables] = {}    # fetch size -> tables of the current fold
        self._recent: dict[int, list] = {}      # client -> [(layer, picks)] of this pass, newest last
        self._prev: dict[int, list] = {}        # client -> the same for its previous pass
        self._pending: dict[int, tuple] = {}    # client -> (target layer, its candidates' bins, or None
        #                                                    and what score.resolve needs: deferred)
        self._deferred: list[tuple] = []        # resolved deferred proposals, for score.resolve at the fold
        self._k: dict[int, int] = {}            # client -> keys in its last fetch
        self._ctx: dict[int, tuple] = {}        # client -> (target layer, _context's answer)
        self._keys: dict[int, list] = {}        # layer -> its keys, expert order
        self.scratch: dict[str, np.ndarray] = {}  # score.scratch's buffers (no state: reused memory)
        self.temper = temper
        self.recall = self._new_recall()           # trajectory matching (recall.py); None: small models

    @property
    def small(self) -> bool:
        return self.experts <= SMALL

    def _new_recall(self) -> Recall | None:
        return None if self.small else Recall(self.layers, self.experts, self.depth, self.temper)

    # -- learning ---------------------------------------------------------------
    def observe(self, client: int, keys) -> None:
        """``client`` fetched ``keys`` (one layer's experts, or several layers')."""
        if not keys:
            return
        first = keys[0][0]
        es = [e for layer, e in keys if layer == first]
        if len(es) == len(keys):                   # (one layer's fetch: the usual)
            groups = {first: es}
        else:
            groups = {}
            for layer, e in keys:
                groups.setdefault(layer, []).append(e)
        for layer, es in groups.items():
            picks = tuple(sorted(set(es)))
            if layer >= self.layers or picks[-1] >= self.experts:
                self._grow(layer + 1, picks[-1] + 1)
            self._observe_layer(client, layer, picks)
        self._k[client] = len(keys)
        if self.c.n >= self._fold_at:
            self.fold()

    def fold_every(self) -> int:
        """Fetches between this fold and the next."""
        return self._fold_at

    def fold(self) -> None:
        """Move what was learned since the last fold into the counts (the proposals see it)."""
        if self._deferred:                         # binned under the tables they were made with
            self.c.cal_vecs.append(self._resolved())
            self._deferred = []
        # Deferred proposals still waiting for their layer's fetch: bin them now, while
        # the counts are those they were made under, and keep the bins as if scored.
        waiting = [(c, pend) for c, pend in self._pending.items() if pend[1] is None]
        if waiting:
            bins = bins_of(self, [(pend[2], pend[0], pend[3], pend[4], pend[6]) for _, pend in waiting])
            for (c, pend), b in zip(waiting, bins):
                res = pend[5]
                if self.small:
                    self._pending[c] = (pend[0], {e: x for e, x in enumerate(b.tolist()) if not res[e]})
                else:
                    self._pending[c] = (pend[0], np.where(np.frombuffer(res, np.bool_), BINS, b))
        self.learned += self.c.pending()
        self.c.fold()
        self._fold_at = min(MAX_FOLD, max(MIN_FOLD, self.learned // FOLD_SHARE))

    def _resolved(self) -> np.ndarray:
        """The deferred proposals' calibration counts, each weighing ``cal_every`` (the
        one sampled in that many: ``_defer``)."""
        return np.bincount(resolve(self, self._deferred), minlength=2 * BINS + 2) * self.cal_every

    def _observe_layer(self, client: int, m: int, picks: tuple) -> None:
        c = self.c
        pend = self._pending.pop(client, None)
        if pend is not None and pend[0] == m:      # resolve the calibration of the last proposal
            if pend[1] is None:                    # deferred: binned at the fold
                self._deferred.append((pend[2], m, pend[3], pend[4], pend[6], pend[5], picks))
            elif self.small:
                cands = pend[1]                    # expert -> its bin, the candidates only
                ci = c.cal_idx
                ci += cands.values()
                for e in picks:
                    b = cands.get(e)
                    if b is not None:
                        ci.append(b + HIT)
            else:
                pb = pend[1]                       # each expert's bin, BINS (discarded) where not a candidate
                c.cal_arrs += (pb, pb.take(picks) + HIT)
        hist = self._recent.get(client)
        if hist and hist[-1][0] >= m:              # a new pass without end_pass (a new token)
            self.end_pass(client)
            hist = self._recent[client]
        if hist:
            self._goes[hist[-1][0]] += 1
        else:                                      # the pass's first layer
            st = self._starts.get(client)
            self._starts[client] = (m, st[0] if st else None)
            if self.recall is not None:
                self.recall.begin(client)
        c.learn(m, self._context(client, m)[1], picks)
        if self.recall is not None:
            self.recall.learn(client, m, picks)
        self._fetched[m] = True
        if hist is None:
            hist = self._recent[client] = []
        hist.append((m, picks))
        del hist[:-self.depth]
        self._ctx.pop(client, None)

    def end_pass(self, client: int) -> None:
        """``client``'s token ended: its next fetch begins a new pass, whose first layer
        takes this pass's last layers as context."""
        hist = self._recent.get(client)
        if self.recall is not None:
            self.recall.end(client)
        if hist:
            self._ends[hist[-1][0]] += 1
            self._prev[client] = hist
            self._recent[client] = []
            self._ctx.pop(client, None)

    def forget(self, client: int) -> None:
        """``client`` left: its context goes (what it taught stays)."""
        for d in (self._recent, self._prev, self._pending, self._k, self._ctx, self._starts):
            d.pop(client, None)
        if self.recall is not None:
            self.recall.forget(client)

    # -- predicting ---------------------------------------------------------------
    def _table(self, client: int) -> Tables:
        E = self.experts
        k = min(max(1, self._k.get(client, 1)), E - 1) if E > 1 else 1
        old = self._tables.get(k)
        if old is not None and old.version == self.c.version:
            return old
        t = self._tables[k] = Tables(self.c, k, self.prior, self.small, self.min_prob)
        if old is not None and old.qall is not None and old.qall.shape == self.c.co.shape:
            t.qall = old.qall                      # (no one reads the old tables after a fold)
        return t

    def propose(self, client: int, layer: int, budget: int, resident=(), floor: float = 0.0,
                room=None) -> list[tuple[tuple[int, int], float]]:
        """Up to ``budget`` keys of ``layer`` not in ``resident`` (a container of keys;
        one with ``row(layer, n)``, as ``k3d.cache.resident.ResidentRows``, answers for
        the whole layer in one call), with confidence at least ``min_prob``, best first
        (ties: lower expert), as (key, confidence).  Remembers the candidates so the
        client's fetch of ``layer`` measures the calibration.  ``floor``: the caller
        takes nothing unless the best confidence is at least this: when none can reach
        it, nothing is scored now (see below).  ``room``: a callable, the most keys the
        caller can take now (the budget is the smaller), asked only once something
        could be proposed: most proposals can give nothing, and the caller's answer
        (``AutoPrefetch._room``) is a sum over clients."""
        if not 0 <= layer < self.layers or (client not in self._recent and client not in self._prev):
            return []
        t = self._table(client)
        # No expert of the layer has a bin reaching min_prob (or, scored densely, the
        # floor): nothing can be proposed whatever the context and the residency.
        best_l = t.best_l[layer]
        if best_l < self.min_prob or (not self.small and best_l < floor - 1e-9):
            self._defer(client, layer, t, None, resident)
            return []
        keys = self._layer_keys(layer)
        # Calibrated on the candidates not resident only: those are the ones read ahead,
        # and being evicted already says something (a key the policy let go is picked
        # less often than its score's bin says on average).  ``res``: a snapshot, kept
        # in _pending (the fold joins the deferred ones' into one array).
        res = residency(resident, layer, keys)
        top = -1.0                                 # the best confidence any candidate's bin has
        for c, e in t.order(layer):
            if not res[e]:
                top = c
                break
        # (score.small's bins are its own: see below)
        idle = False
        if not self.small and top >= self.min_prob:
            idle = top < floor - 1e-9
            if not idle and room is not None:      # something could be taken: the room bounds it
                budget, room = min(budget, room()), None
            idle = idle or budget <= 0
        if top < self.min_prob or idle:
            # Nothing can be proposed, or (``idle``) taken, whatever the context (the 1e-9
            # is far above rounding, far below any confidence's step): the candidates'
            # bins only feed the calibration, which moves at the fold, so they are
            # computed there, for all such proposals at once (score.resolve), as
            # score.dense computes them.  score.small's arithmetic may give another bin
            # at an exact edge, so a small model defers only what it always deferred.
            self._defer(client, layer, t, res)
            return []
        parts, rows, sizes = self._context(client, layer)
        if self.small:
            best, cands = small(self, t, layer, parts, res)
        else:
            votes = self._votes(client, layer, rows)
            best, cands = dense(self, t, layer, parts, rows, np.frombuffer(res, np.bool_), sizes, votes)
        self._pending[client] = (layer, cands)
        if not best:
            return []
        if room is not None:
            budget = min(budget, room())
        best.sort()
        return [(keys[e], -c) for c, e in best[:max(0, budget)]]

    def _votes(self, client: int, layer: int, rows):
        """Recall's votes for ``layer`` from the client's context ``rows``, when they are of
        this pass (a pass's first layer, whose context is the pass before, has none)."""
        r = self.recall
        return r.votes(layer, rows, VOTES) if r is not None and self._recent.get(client) else None

    def _layer_keys(self, layer: int) -> list:
        keys = self._keys.get(layer)
        if keys is None or len(keys) != self.experts:
            keys = self._keys[layer] = [(layer, e) for e in range(self.experts)]
        return keys

    def _defer(self, client: int, layer: int, t: Tables, res, resident=()) -> None:
        """A proposal of ``layer`` that proposes nothing: one in ``cal_every`` (by a count of
        them: a function of the stream, so replay samples the daemon's) is kept for the
        calibration, binned at the fold weighing ``cal_every``; the others leave nothing.
        On streams with little to predict these are the bulk of the calibration, and
        binning each costs a gather of its context rows: the sample estimates the same
        frequencies, unbiased, at a fraction of the cost.  ``res``: the residency
        bytes, when the caller read them."""
        self._deferrals += 1
        if self._deferrals % self.cal_every:
            self._pending.pop(client, None)
            return
        if res is None:
            res = residency(resident, layer, self._layer_keys(layer))
        _, rows, sizes = self._context(client, layer)
        votes = self._votes(client, layer, rows)
        self._pending[client] = (layer, None, t, rows, sizes, res, votes)

    # -- shape and warm restart ------------------------------------------------------
    def _grow(self, layers: int, experts: int) -> None:
        L, E = max(layers, self.layers), max(experts, self.experts)
        if (L, E) == (self.layers, self.experts):
            return
        self.fold()                                # the buffers' indices are of the old shape
        old = self.c
        self.layers, self.experts = L, E
        self.c = Counts(L, E, self.depth, self.window)
        self.c.take(old)
        self.recall = self._new_recall()           # (a pass's row is of the old shape)
        self._fetched += [False] * (L - len(self._fetched))
        self._ends += [0] * (L - len(self._ends))
        self._goes += [0] * (L - len(self._goes))
        self._reset_derived()

    def _reset_derived(self) -> None:
        self._ctx.clear()                          # row numbers depend on the expert count
        self._pending.clear()
        self._keys.clear()
        self._tables.clear()

    def state(self) -> dict:
        """The learned counts as folded, JSON-able (``saved.dump``)."""
        return saved.dump(self.name, self.layers, self.experts, self.depth, self.c,
                          self._resolved() if self._deferred else None)

    def restore(self, state: dict) -> None:
        """Take saved counts; ValueError (nothing changed) if malformed or of another shape."""
        new = saved.load(state, self.name, self.depth, self.window, self.layers, self.experts)
        L, E = new.layers, new.experts
        if (L, E) != (self.layers, self.experts):
            self.layers, self.experts = L, E
            self.recall = self._new_recall()
        self.c = new
        self._deferred = []
        self.learned = int(new.visits.sum())
        self._fold_at = min(MAX_FOLD, max(MIN_FOLD, self.learned // FOLD_SHARE))
        self._fetched = [bool(v) for v in new.visits.tolist()]
        self._ends, self._goes = [0] * L, [0] * L
        self._reset_derived()
