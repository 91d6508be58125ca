"""Fetch latency histogram: seconds from a fetch's arrival to its reply, by result.

A fetch is classified by its worst key: ``miss`` if any key was read for it,
else ``waited`` if any key was still being read (a prediction's or another
client's read), else ``hit``.  Buckets are fixed (Prometheus style: cumulative
counts per upper bound ``le``, plus ``+Inf`` = ``count``), so a status taken at
any moment carries the whole histogram and ``/metrics`` exports exactly it.

Owned by the server thread (``record`` is called where replies are sent); the
status dict carries a copy, so no locking.
"""

from __future__ import annotations

import bisect

RESULTS = ("hit", "miss", "waited")
# 50 µs .. 10 s: from a hit (a round trip) through a warm miss (a memory copy) to a cold remote read.
BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
           0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class FetchLatency:
    def __init__(self):
        self._counts = {r: [0] * (len(BUCKETS) + 1) for r in RESULTS}   # per bucket, not cumulative
        self._sum = {r: 0.0 for r in RESULTS}

    def record(self, result: str, seconds: float) -> None:
        self._counts[result][bisect.bisect_left(BUCKETS, seconds)] += 1
        self._sum[result] += seconds

    def as_dict(self) -> dict:
        """``{le: [...], hit: {buckets: [cumulative per le], count, sum}, miss: ..., waited: ...}``."""
        out: dict = {"le": list(BUCKETS)}
        for r in RESULTS:
            cum, total = [], 0
            for n in self._counts[r]:
                total += n
                cum.append(total)
            out[r] = {"buckets": cum[:-1], "count": total, "sum": round(self._sum[r], 6)}
        return out


def classify(misses: int, waited: int) -> str:
    return "miss" if misses else "waited" if waited else "hit"
