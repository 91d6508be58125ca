"""Fair share of the daemon's CPU between clients: a client far over its share waits.

Why: ``turns`` orders the requests that are waiting, but the clients are
synchronous (one request out at a time), so the loop is rarely backlogged and
a client that sends as fast as it is answered is served as fast as it sends.
On a host whose cores are busy with the model processes, everything the daemon
does for such a client (its loop time, its reads, its own process waking up
again) is CPU taken from the others, and their latency grows with it.  Pacing
delays that client's next request, so it sleeps in ``recv`` instead.

Accounting: each client is charged the CPU seconds spent for it, measured on
the thread that spent them (``time.thread_time``): the server loop's handling
of its requests and the reader threads' reads for its loads.  Usage decays
exponentially with time constant ``TAU`` seconds, so ``usage / TAU`` is a
moving CPU rate.  Because every client's usage decays alike, the total decays
alike too and is kept in one number (exact).  Cost: ``charge`` is O(1);
``delay`` and ``active`` are O(charged clients): they scan every client's usage
for the ones active now (``delay`` is O(1) while no more clients were ever
charged than ``share``, when nobody can be over it).

Rule: while ``n`` clients are active (charged within ``ACTIVE`` seconds) and
``n > share``, a client may use at most ``share`` times the average client's
usage, itself included: its usage ``u`` is held to
``cap = share * others / (n - share)``, the fixed point of
``u <= share * (u + others) / n`` (at 17 clients and share 2 that is 2.13x the
others' average).  In ``others`` each active client counts at least ``FLOOR``,
so that clients sending a request now and then do not pull the cap of a busy
one down to nothing; and a client under ``FLOOR`` (a CPU rate) is never paced.
Alone, or with one other at the default share 2, nobody is: pacing protects
many clients from one.  Over its cap, a client waits until its usage would
have decayed to the cap while the others go on as they are:
``TAU * ln(u / cap)``, at most ``MAX_DELAY``; a wait under ``MIN_DELAY`` is
not worth a hold.  If the others stop, they stop counting as active within
``ACTIVE`` seconds, and the holds with them.

Pure: no clock, no threads; the server thread passes ``now`` (monotonic
seconds) and owns the object.
"""

from __future__ import annotations

import math

TAU = 1.0            # seconds: the usage memory
FLOOR = 0.01         # CPU seconds per second a client may always use (1 % of a core)
MAX_DELAY = 0.5      # seconds: the longest one wait (client timeouts are far longer)
MIN_DELAY = 0.001    # seconds: a shorter wait is not held (the loop's poll has 1 ms steps)
ACTIVE = TAU / 2     # a client charged within this long counts as active


class Pacer:
    def __init__(self, live, tau: float = TAU, floor: float = FLOOR, max_delay: float = MAX_DELAY):
        """``live.max_share`` (read at each use, ``k3d.config.Live``): how many times the
        average client's usage one client may use; 0 turns pacing off."""
        self.live, self.tau, self.max_delay = live, tau, max_delay
        self.floor = floor * tau                       # in usage units (CPU seconds, decayed)
        self._usage: dict[int, list[float]] = {}        # client -> [usage, as of when]
        self._total = 0.0
        self._t_total = 0.0

    def _decay(self, value: float, since: float, now: float) -> float:
        return value * math.exp(-(now - since) / self.tau) if now > since else value

    def usage(self, client: int, now: float) -> float:
        """The client's decayed CPU usage (seconds); ``usage / tau`` is its recent CPU rate."""
        u = self._usage.get(client)
        return self._decay(u[0], u[1], now) if u else 0.0

    def total(self, now: float) -> float:
        return self._decay(self._total, self._t_total, now)

    def charge(self, client: int, seconds: float, now: float) -> None:
        """``seconds`` of CPU were spent for ``client``."""
        if seconds <= 0:
            return
        u = self._usage.setdefault(client, [0.0, now])
        u[0] = self._decay(u[0], u[1], now) + seconds
        u[1] = now
        self._total = self.total(now) + seconds
        self._t_total = now

    def forget(self, client: int, now: float) -> None:
        """The client left: its usage leaves the total."""
        u = self._usage.pop(client, None)
        if u is not None:
            self._total = max(0.0, self.total(now) - self._decay(u[0], u[1], now))
            self._t_total = now

    def _active(self, now: float) -> dict[int, float]:
        """Decayed usage of every client charged within ``ACTIVE``."""
        return {c: self._decay(v, t, now) for c, (v, t) in self._usage.items() if now - t <= ACTIVE}

    def active(self, now: float) -> int:
        return len(self._active(now))

    def delay(self, client: int, now: float) -> float:
        """Seconds ``client``'s next request should wait (0: serve it)."""
        share = self.live.max_share
        if not share or len(self._usage) <= share:
            return 0.0                          # too few clients charged at all for anyone to be over
        u = self.usage(client, now)
        if u <= self.floor:
            return 0.0
        others = [max(self.floor, v) for c, v in self._active(now).items() if c != client]
        n = len(others) + 1
        if n <= share:
            return 0.0
        cap = max(self.floor, share * sum(others) / (n - share))
        if u <= cap:
            return 0.0
        wait = min(self.max_delay, self.tau * math.log(u / cap))
        return wait if wait >= MIN_DELAY else 0.0
