"""The co-activation predictor's counts across a restart: their JSON-able form, and its check.

Layout (``dump``'s dict, what the daemon's ``--state-dir`` file keeps)::

    {"predictor": name, "layers": L, "experts": E, "depth": D,
     <each array of counts.Counts.views()>: [[index..., count], ...]   (nonzero entries only)
     "cal_n": [BINS ints], "cal_hit": [BINS ints]}

Invariant: ``load`` returns new ``Counts`` only if every entry is in range (each index
within its array's shape, each count below the window, ``0 <= cal_hit <= cal_n``) and
the state is this predictor's at this depth; else it raises ValueError and nothing of
the caller's changes.  A saved shape smaller than the model's grows to it (experts
seen since).  Recall's passes are not kept: they are what the requests of the day did.

Pure functions; the caller's thread (the predictor's owner).
"""

from __future__ import annotations

import numpy as np

from k3d.cache.predict.counts import BINS, HIT, Counts


def dump(name: str, layers: int, experts: int, depth: int, counts: Counts, resolved=None) -> dict:
    """The counts as folded, JSON-able (sparse); ``resolved``: calibration of deferred
    proposals resolved since the fold (``Counts.snapshot``), or None."""
    def sparse(arr):
        idx = np.nonzero(arr)
        return [[*map(int, i), int(arr[i])] for i in zip(*idx)]
    blk, visits, cal = counts.snapshot(resolved)
    return {"predictor": name, "layers": layers, "experts": experts, "depth": depth,
            **{k: sparse(arr) for k, arr in counts.views(blk, visits).items()},
            "cal_n": [int(x) for x in cal[:BINS]], "cal_hit": [int(x) for x in cal[HIT:HIT + BINS]]}


def load(state: dict, name: str, depth: int, window: int, layers: int, experts: int) -> Counts:
    """New ``Counts`` from a saved ``state`` (module docstring), at least ``layers`` x
    ``experts``; ValueError, in one line, if it is malformed or not this predictor's."""
    try:
        if state.get("predictor") != name or int(state["depth"]) != depth:
            raise ValueError("saved by another predictor or depth")
        L, E = int(state["layers"]), int(state["experts"])
        if not (0 < L <= 4096 and 0 < E <= 4096):
            raise ValueError("shape out of range")
        new = Counts(max(L, layers), max(E, experts), depth, window)
        for key, arr in new.views().items():
            for row in state[key]:
                *idx, val = (int(x) for x in row)
                if not 0 <= val < new.window or len(idx) != arr.ndim or \
                        any(not 0 <= i < s for i, s in zip(idx, arr.shape)):
                    raise ValueError(f"{key} entry out of range")
                arr[tuple(idx)] = val
        cal_n = np.array([int(x) for x in state["cal_n"]], np.int64)
        cal_hit = np.array([int(x) for x in state["cal_hit"]], np.int64)
        if cal_n.shape != (BINS,) or cal_hit.shape != (BINS,) or (cal_hit < 0).any() or (cal_hit > cal_n).any():
            raise ValueError("calibration out of range")
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"malformed predictor state: {e}") from None
    new.cal_n[:], new.cal_hit[:] = cal_n, cal_hit
    return new
