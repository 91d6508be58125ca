"""Scoring a layer's experts for ``CoPredictor.propose``, from one fold's tables.

Two ways to the same quantities (``coact``'s docstring): ``small`` for models of up
to ``SMALL`` experts, in plain Python lists (a handful of experts costs less as list
arithmetic than as numpy calls, each of which has a fixed cost), and ``dense`` with
one numpy gather of the context rows for larger models.  Both return

    (best, cands): best = [(-confidence, expert)] of the candidates (experts whose
    key is not resident: ``res[e]`` false; ``small`` takes the mask as bytes,
    ``dense`` as a bool array) at ``min_prob`` or more, unsorted; cands = each
    candidate's calibration bin (``small``: {expert: bin}; ``dense``: an array of
    the experts' bins, BINS where not a candidate), which the caller keeps until the
    layer's fetch resolves them.

``resolve`` bins, at a fold and all at once, the candidates of proposals that could
propose, or have taken, nothing (``CoPredictor.propose``): their bins only feed the
calibration.

Pure: reads the predictor's folded counts and ``Tables``; the caches here are
keyed by shapes only (subsets of ``experts``, context sizes), never by counts.
What it writes is memory reused between calls (``scratch``: the predictor's
buffers; a ``Tables``' q rows, ``layer_q``), never anything a result depends on
but the counts.
Bins: raw probability o / (1 + o) in [b / BINS, (b + 1) / BINS).  ``small`` takes
the bin by arithmetic, ``dense`` by ``searchsorted`` on the same edges; they may
differ at an exact edge by rounding, which is harmless: one predictor always uses
one of them (by its expert count), so the daemon and replay agree.
"""

from __future__ import annotations

from itertools import combinations
from math import comb, prod

import numpy as np

from k3d.cache.predict.counts import BINS, HIT, Tables
from k3d.cache.predict.recall import PRIOR

EDGES = np.array([i / (BINS - i) for i in range(1, BINS)])  # bin i's lower edge, as odds
P_EDGES = np.array([i / BINS for i in range(1, BINS)])      # ... as a probability (mixed scores: mix)
SMALL = 16              # models of at most this many experts score with lists
SUBSETS = 128           # a context layer's picks: every set of their size tabulated at once up to this many
Q_ROWS_FROM = 128       # dense: keep a layer's q rows for the fold once folds are this many fetches apart
CHUNK = 8192            # bins_of: q values (proposals x context layers x experts) per step: 64 KiB
Q_BYTES = 32 << 20      # dense: whole layers' q rows are kept only while all layers' fit in this (float64)
MIX = 0.5               # dense: the naive-Bayes probability's share of the mix with recall's votes

_subsets_of: dict[tuple, tuple] = {}       # (experts, size) -> subsets' answer
_averaging: dict[tuple, np.ndarray] = {}   # context group sizes -> the matrix averaging each group


def small(p, t: Tables, m: int, parts, res) -> tuple[list, dict]:
    """``p``'s scores of layer ``m``'s experts given the context ``parts``, in lists."""
    fs = factors(p, t, m, parts)
    # odds = prod_d (q_d / (1 - q_d) * io)^w_d / io: each factor carries its io, inv_io takes
    # one back (multiplied left to right, as prod does: the same floats)
    if len(fs) == 4:                               # (the usual context: depth 4)
        f1, f2, f3, f4 = fs
        odds = [a * b * c * d * i for a, b, c, d, i in zip(f1, f2, f3, f4, t.inv_io_l[m])]
    else:
        fs.append(t.inv_io_l[m])
        odds = list(map(prod, zip(*fs)))
    ct, E, mp = t.ct_l[m], p.experts, p.min_prob
    cands, best = {}, []
    for e in range(E):
        if res[e]:
            continue
        o = odds[e]
        b = int(o * BINS / (1.0 + o))              # the bin of the raw probability o / (1 + o)
        if b >= BINS:
            b = BINS - 1
        cands[e] = b
        conf = ct[b * E + e]
        if conf >= mp:
            best.append((-conf, e))
    return best, cands


def factors(p, t: Tables, m: int, parts) -> list[list[float]]:
    """The context layers' odds factors for layer ``m``, times ``io``: per part (distance
    ``d``, ``picks``) and expert ``e``, q / (1 - q) * io[e], q the mean over ``picks`` of
    (co + prior * pm) / (seen + prior).  When the picks' size has few sets, a fold's
    first use computes every set of every layer in one numpy pass and a fetch turns
    its rows into lists (a row at a time: cheaper than numpy's fancy indexing, or
    ``tolist`` of the whole table at every fold); else each is computed once per fold
    (memoised in ``t.memo``)."""
    if not parts:
        return []
    n = len(parts[0][1])
    index, vals = set_table(p, t, n)
    if index is not None and all(len(ps) == n for _, ps in parts):
        vm = vals[m]
        return [vm[d - 1][index[ps]].tolist() for d, ps in parts]
    out = []
    for d, picks in parts:
        f = t.memo.get((m, d, picks))
        if f is None:
            index, vals = set_table(p, t, len(picks))
            if index is not None:
                f = vals[m, d - 1, index[picks]].tolist()
            else:
                base = (d - 1) * p.experts
                q = vals[m].take([base + a for a in picks], 0).sum(0) * (1.0 / len(picks))
                f = ((q / (1.0 - q) * t.io[m]) ** p.weights[d - 1]).tolist()
            t.memo[(m, d, picks)] = f
        out.append(f)
    return out


def set_table(p, t: Tables, n: int) -> tuple:
    """(subset index or None, the factors of every n-subset (L, D, sets, E), or the rows
    (co + prior * pm) / (seen + prior) (L, D * E, E) when there are too many sets)."""
    tab = t.sets.get(n)
    if tab is None:
        c, L, D, E = p.c, p.layers, p.depth, p.experts
        index, cols = subsets(E, n)
        # (in place, and ``take`` rather than fancy indexing: once per fold, ~3x faster
        # than the plain expressions, with the same operations in the same order)
        rows = np.add(c.co, t.ppm[:, None, :])
        rows /= (c.seen + p.prior)[:, :, None]                                      # (L, D * E, E)
        if index is not None:
            r4 = rows.reshape(L, D, E, E)
            q = r4.take(cols[0], axis=2)                                            # (L, D, sets, E)
            for col in cols[1:]:
                q += r4.take(col, axis=2)
            q *= 1.0 / n
            rows = np.subtract(1.0, q)
            np.divide(q, rows, out=rows)                                            # q / (1 - q) ...
            rows *= t.io[:, None, None, :]                                          # ... * io
            rows **= p.weights_v[None, :, None, None]                               # ... tempered
        tab = t.sets[n] = (index, rows)
    return tab


def subsets(experts: int, n: int) -> tuple:
    """({sorted n-subset of the experts: its number}, [the subsets' j-th members, per j]),
    or (None, None) when there are over SUBSETS."""
    got = _subsets_of.get((experts, n))
    if got is None:
        got = (None, None)
        if comb(experts, n) <= SUBSETS:
            sets = list(combinations(range(experts), n))
            got = ({s: i for i, s in enumerate(sets)}, list(np.array(sets, np.int64).reshape(len(sets), n).T))
        _subsets_of[(experts, n)] = got
    return got


def averaging(sizes: tuple) -> np.ndarray:
    """The matrix that averages each group of rows of these sizes (one row per group)."""
    avg = _averaging.get(sizes)
    if avg is None:
        avg = _averaging[sizes] = np.zeros((len(sizes), sum(sizes)))
        start = 0
        for i, n in enumerate(sizes):
            avg[i, start:start + n] = 1.0 / n
            start += n
    return avg


VOTES = (1.0 - MIX) / (1.0 + PRIOR)   # recall's votes' weight in the mix (recall.Recall.votes's scale)


def mix(odds: np.ndarray, votes: np.ndarray, t: Tables, m: int) -> np.ndarray:
    """The probability ``MIX`` times naive Bayes's (``odds`` / (1 + ``odds``)) plus the rest
    times ``recall``'s vote share shrunk towards the plain rate by ``recall.PRIOR``:
    ``votes`` come scaled by ``VOTES``, and ``t.pm_mix`` is the plain rate's part, one
    product per fold.  Binned on ``P_EDGES`` (``odds`` may be a batch, ``m`` layers)."""
    if t.pm_mix is None:
        t.pm_mix = t.pm * (VOTES * PRIOR)
    pr = odds / (1.0 + odds)
    pr *= MIX
    pr += votes
    pr += t.pm_mix[m]
    return pr


def bins_of(p, items) -> np.ndarray:
    """The raw-score bins (N, E) of proposals (tables, layer, context rows, context
    sizes, recall's votes or None), scored as ``dense`` would have under those tables: the counts must not
    have moved since they were made (call before the fold).  Vectorised over the
    items of one shape: a layer with enough of them (their rows at least half its
    table, or its table already made) gathers from its q rows (``layer_q``); the
    others (short folds) gather from the counts, all layers at once.  The same
    arithmetic either way (element-wise + and /: exact).  Temporaries stay small
    (``CHUNK``; a layer's gather goes to ``scratch``): a fresh array of megabytes
    costs a page fault per 4 KiB, at every fold."""
    c, E = p.c, p.experts
    R = c.seen.shape[1]
    out = np.zeros((len(items), E))           # odds, then (the end) mixed and binned
    groups: dict[tuple, list] = {}
    for i, (t, m, rows, sizes, _) in enumerate(items):
        groups.setdefault((t, sizes), []).append((i, m, rows))
    for (t, sizes), entries in groups.items():
        if not sizes:
            M = np.array([e[1] for e in entries], np.int64)
            out[[e[0] for e in entries]] = 1.0 / t.io[M]
            continue
        by_layer: dict[int, list] = {}
        for e in entries:
            by_layer.setdefault(e[1], []).append(e)
        n, avg = sum(sizes), averaging(sizes)
        step = max(1, CHUNK // (len(sizes) * E))
        rest = []
        for m, run in by_layer.items():
            if m not in t.q and (2 * len(run) * n < R or not keeps_q(p)):
                rest += run
                continue
            qm = layer_q(p, t, m)
            for at in range(0, len(run), step):
                part = run[at:at + step]
                g = qm.take(np.array([e[2] for e in part], np.int64), 0, out=scratch(p, "g", (len(part), n, E)))
                _bins(p, out, part, avg @ g, t.io[m], sizes)
        for at in range(0, len(rest), step):
            part = rest[at:at + step]
            M = np.array([e[1] for e in part], np.int64)
            Rr = np.array([e[2] for e in part], np.int64)                                  # (N, rows)
            g = (c.co[M[:, None], Rr] + t.ppm[M][:, None, :]) / (c.seen[M[:, None], Rr] + p.prior)[:, :, None]
            _bins(p, out, part, avg @ g, t.io[M], sizes)
    bins = EDGES.searchsorted(out, side="right")
    voted: dict[Tables, list] = {}
    for i, (t, m, _, _, votes) in enumerate(items):
        if votes is not None:
            voted.setdefault(t, []).append((i, m, votes))
    for t, run in voted.items():                   # (as dense mixes them: one batch per tables)
        idx = [i for i, _, _ in run]
        bins[idx] = P_EDGES.searchsorted(mix(out[idx], np.array([v for _, _, v in run]), t,
                                             [m for _, m, _ in run]), side="right")
    return bins


def _bins(p, out, part, q, io, sizes: tuple) -> None:
    """``out``'s rows (odds) of ``part`` from its q rows averaged per context layer (N, groups, E):
    odds = prod_d (q_d / (1 - q_d) * io)^w_d / io, w_d the weight of the group's distance
    (read off its first row: ``(d - 1) * E + a``)."""
    f = q / (1.0 - q)
    f *= io[:, None, :] if io.ndim == 2 else io
    starts = np.cumsum((0,) + sizes[:-1])
    d0 = np.array([e[2] for e in part], np.int64)[:, starts] // p.experts      # (N, groups): d - 1
    f **= p.weights_v[d0][:, :, None]
    odds = np.multiply.reduce(f, axis=1)
    odds /= io
    out[[e[0] for e in part]] = odds


def scratch(p, name: str, shape: tuple, dtype=np.float64) -> np.ndarray:
    """A C-contiguous array of ``shape`` in ``p``'s reusable buffer ``name``: what a
    gather writes to, so a fold allocates no large temporaries.  Valid until the
    next call for ``name``."""
    size = prod(shape)
    buf = p.scratch.get(name)
    if buf is None or buf.size < size or buf.dtype != dtype:
        buf = p.scratch[name] = np.empty(max(size, 2 * (0 if buf is None else buf.size)), dtype)
    return buf[:size].reshape(shape)


def resolve(p, deferred) -> np.ndarray:
    """Calibration buffer indices (``counts``: a candidate's bin, and HIT + bin where it was
    picked) of the proposals ``propose`` deferred, all at once: entries (tables, layer,
    context rows, context sizes, recall's votes or None, resident mask (bytes, 1: resident),
    picks); see ``bins_of``."""
    if not deferred:
        return np.zeros(0, np.int64)
    bins = bins_of(p, [e[:5] for e in deferred])
    # (the masks are bytes of 0 / 1, one per expert, all of one length: one shape per fold)
    cand = ~np.frombuffer(b"".join([e[5] for e in deferred]), np.bool_).reshape(bins.shape)
    hit = np.zeros(cand.shape, bool)
    hit[[i for i, e in enumerate(deferred) for _ in e[6]], [x for e in deferred for x in e[6]]] = True
    return np.concatenate((bins[cand], bins[cand & hit] + HIT))


def layer_q(p, t: Tables, m: int) -> np.ndarray:
    """Layer ``m``'s (co + prior * pm) / (seen + prior), all D * E rows of E, made at
    its first use in the fold and kept (``t.q``: rows of ``t.qall``, a buffer the
    next fold's tables of the same fetch size take over: ``CoPredictor._table``)."""
    got = t.q.get(m)
    if got is None:
        c = p.c
        if t.qall is None:
            t.qall = np.empty(c.co.shape)         # (L, D * E, E), filled a layer at a time
        got = t.q[m] = np.add(c.co[m], t.ppm[m], out=t.qall[m])
        np.divide(got, (c.seen[m] + p.prior)[:, None], out=got)
    return got


def keeps_q(p) -> bool:
    """Whole layers' q rows may be kept (``layer_q``): all of them (8 * L * D * E**2
    bytes) fit in ``Q_BYTES``.  Above it (DeepSeek-, Kimi-sized models) a fetch gathers
    only its rows, and the predictor's memory stays its counts' (``counts.nbytes``)."""
    return 8 * p.c.co.size <= Q_BYTES


def q_rows(p, t: Tables, m: int, rows) -> np.ndarray:
    """``rows`` of layer ``m``'s q rows (``layer_q``).  Once the folds are far enough
    apart to pay for it (``Q_ROWS_FROM`` fetches or more), the whole layer's are
    made at the fold's first use and kept; before, only the rows asked for, per
    fetch."""
    got = t.q.get(m)
    if got is not None:
        return got.take(rows, 0)
    if p.fold_every() >= Q_ROWS_FROM and keeps_q(p):
        return layer_q(p, t, m).take(rows, 0)
    c = p.c
    idx = np.array(rows, np.int64)
    return (c.co[m].take(idx, 0) + t.ppm[m]) / (c.seen[m].take(idx) + p.prior)[:, None]


def dense(p, t: Tables, m: int, parts, rows, res: np.ndarray, sizes: tuple = (),
          votes: np.ndarray | None = None) -> tuple[list, np.ndarray]:
    """As ``small``, with one gather of the context rows (many experts); ``sizes``: the
    parts' pick counts (``CoPredictor._context``'s); ``votes``: ``recall``'s, mixed in
    (``mix``) before binning."""
    E = p.experts
    if parts:
        sizes = sizes or tuple(len(ps) for _, ps in parts)
        # per context layer: mean over its picks a of (co[a, e] + prior * pm) / (seen[a] + prior)
        q = averaging(sizes) @ q_rows(p, t, m, rows)
        # naive Bayes, tempered: each layer's odds ratio to the prior, to the power of its
        # distance's weight, multiply over the prior odds (counted once)
        f = q / (1.0 - q)
        f *= t.io[m]
        f **= p.weights_v[[d - 1 for d, _ in parts]][:, None]
        odds = np.multiply.reduce(f, axis=0)
        odds /= t.io[m]
    else:
        odds = 1.0 / t.io[m]
    if votes is not None:
        b = P_EDGES.searchsorted(mix(odds, votes, t, m), side="right")
    else:
        b = EDGES.searchsorted(odds, side="right")
    pb = np.where(res, BINS, b)
    conf = t.ct_dense(m).take(pb * E + t.ar)       # (a resident expert's bin BINS: -1)
    ok = (conf >= p.min_prob).nonzero()[0]
    if not ok.size:                                # the usual answer: skip the lists
        return [], pb
    return list(zip((-conf[ok]).tolist(), ok.tolist())), pb
