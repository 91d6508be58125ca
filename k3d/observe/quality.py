"""Prediction quality for status: per client and in total, from the store's figures.

- precision: prefetch_hits / prefetched (a prediction is a hit when anyone fetches
  its key before the predicting client's next token);
- timeliness of fetched keys: ready (resident and read), waited (still being read:
  a prediction or another client's read), missed (read on demand);
- unused_bytes: bytes read for predictions nobody fetched in time;
- refused: predictions not read because the only victim was expected to be reused
  sooner (``Store.predict``).

Pure functions of the store's ``PredictionBook`` (``Store.book``; owned by the server thread).
"""

from __future__ import annotations

from dataclasses import fields

from k3d.observe.stats import PredictionStats


def total(store) -> PredictionStats:
    """Sum over every client the store has figures for (gone clients' figures are kept
    in ``store.book.quality_gone``)."""
    out = PredictionStats()
    names = [f.name for f in fields(PredictionStats)]
    for q in [*store.book.quality.values(), store.book.quality_gone]:
        for n in names:
            setattr(out, n, getattr(out, n) + getattr(q, n))
    return out


def section(store, client_ids, auto=None) -> dict:
    """``status["prediction"]``: {"total": {...}, "clients": {id: {...}}, "daemon": {...}}.

    ``total`` covers every prediction (clients' and the daemon's); ``clients`` a
    client's own; ``daemon`` (``--predict auto`` only: ``AutoPrefetch.as_dict``)
    the daemon's own predictor's: issued, used (in time / late), unused,
    unused_bytes, refused."""
    out = {"total": total(store).as_dict(),
           "clients": {str(c): store.book.client_quality(c).as_dict() for c in client_ids}}
    if auto is not None:
        out["daemon"] = auto.as_dict()
    return out

