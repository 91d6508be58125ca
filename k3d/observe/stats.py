"""Counters (``total``-style, only grow), per-client prediction counts
(``PredictionStats``: precision, timeliness of fetched keys) and the reader
throughput window.

Naming follows memcached/Redis: counters are monotonic totals, gauges
(``used``, ``pinned``, ``loading``) are computed from state when status is asked.
Each fetched key counts exactly one hit or one miss; ``waited`` is the subset of
hits that were still loading (a prediction's or another client's read).

Owned by the server thread; no locking.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass


@dataclass
class Counters:
    fetches: int = 0
    hits: int = 0
    misses: int = 0
    waited: int = 0
    prefetched: int = 0         # background reads issued for predictions
    prefetch_hits: int = 0      # predictions fetched before the predictor's next token
    prefetch_unused: int = 0    # predictions never fetched (demoted or evicted)
    prefetch_unused_bytes: int = 0  # bytes read for predictions never used
    prefetch_refused: int = 0   # predictions not read: the only victim was expected to be reused sooner
    evictions: int = 0
    warm_loaded: int = 0        # reads a warm restart queued for the saved hot set
    loading_skips: int = 0      # the policy's victim was still loading (a run with 0 replays exactly)
    bytes_read: int = 0
    read_seconds: float = 0.0   # summed over reader threads
    errors: int = 0             # failed expert reads
    bad_requests: int = 0
    requests_over_cap: int = 0  # of those, refused because their client had wire.MAX_QUEUED waiting
    cache_full: int = 0
    clients_dead: int = 0
    paced: int = 0              # times a client over its CPU share was held back (k3d/serve/pacing.py)
    paced_seconds: float = 0.0  # seconds clients were held back, summed
    client_hits: int = 0        # hits clients answered from the shared index (reported later; in ``hits``)
    late_hits: int = 0          # of those, reported after the key had left its slot (the view stayed valid)
    bad_reports: int = 0        # reported slots refused: the client could not have read them, or over its quota
    slots_busy: int = 0         # fetches told to retry: the slots they needed still waited for reuse
    evicted_ahead: int = 0      # evictions made ahead of misses while several clients read the index
    layers_done: int = 0        # layers clients said they were done with mid-token (``done``)
    pins_done: int = 0          # pins those releases dropped before the clients' next token

    def as_dict(self) -> dict:
        d = asdict(self)
        d["read_seconds"] = round(d["read_seconds"], 6)
        d["paced_seconds"] = round(d["paced_seconds"], 6)
        return d


@dataclass
class PredictionStats:
    """One client's predictions and the timeliness of its fetched keys (status: per client).

    ``ready``/``waited``/``missed`` split the client's fetched keys: resident and
    read, still being read (a prediction's or another client's read), read on demand."""
    prefetched: int = 0         # background reads this client's predictions started
    prefetch_hits: int = 0      # of those, fetched (by anyone) before its next token
    prefetch_unused: int = 0    # of those, not fetched by then
    unused_bytes: int = 0       # bytes read for the unused ones
    refused: int = 0            # predictions not read (no slot worth evicting)
    ready: int = 0
    waited: int = 0
    missed: int = 0

    @property
    def precision(self) -> float | None:
        return self.prefetch_hits / self.prefetched if self.prefetched else None

    def confidence(self) -> float:
        """Precision with a uniform prior (Laplace): what a new prediction is worth."""
        return (self.prefetch_hits + 1) / (self.prefetch_hits + self.prefetch_unused + 2)

    def as_dict(self) -> dict:
        d = asdict(self)
        p = self.precision
        d["precision"] = None if p is None else round(p, 4)
        return d


class Throughput:
    """Bytes completed in the last ``window`` seconds (times from the caller)."""

    def __init__(self, window: float = 10.0):
        self.window = window
        self._events: deque[tuple[float, int]] = deque()

    def add(self, now: float, nbytes: int) -> None:
        self._events.append((now, nbytes))
        self._trim(now)

    def rate(self, now: float) -> float:
        self._trim(now)
        return sum(n for _, n in self._events) / self.window

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window:
            self._events.popleft()
