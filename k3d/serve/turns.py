"""Fair share of the server loop between clients: deficit round-robin over requests.

The loop drains the ROUTER socket into ``Turns`` (one FIFO per client, by
routing id) and takes requests back out one at a time with ``pop``.  Clients
with requests waiting take turns in a ring; each turn a client gets ``quantum``
units of credit and is served while its next request's cost fits its credit
(deficit round-robin: Shreedhar & Varghese).  A request's cost is what the
loop will spend on it, estimated before decoding from its size: one unit per
request plus one per ``UNIT_BYTES`` of message (about one key per unit), so a
client flooding 512-key predictions is served one of them per few turns of
everyone else's 4-key fetches, not one for one.  Credit is forfeited when a
client's queue empties (DRR's rule: idle clients do not hoard credit).

ZeroMQ's ROUTER already fair-queues *messages* between peers; this adds
*cost*, and lets the loop see every waiting request before it chooses.

A client may be held until a given time (``hold``: ``pacing.py`` decided it
used far more than its share): its requests stay queued, in order, and ``pop``
passes it by until then; ``next_release`` says when the loop should look again.

Pure data structure, owned by the server thread; no sockets.  The clock is the
caller's: ``pop`` and ``next_release`` take ``now`` (monotonic seconds).
"""

from __future__ import annotations

from collections import deque

UNIT_BYTES = 8         # ~ one [layer, expert] pair in msgpack
QUANTUM = 64           # units of credit per turn: a fetch of up to ~50 keys fits one turn
MAX_COST = 4 * QUANTUM  # no request waits more than a few turns for its credit


def cost_of(nbytes: int) -> int:
    return min(MAX_COST, 1 + nbytes // UNIT_BYTES)


class Turns:
    def __init__(self, quantum: int = QUANTUM):
        self.quantum = quantum
        self._queues: dict[bytes, deque] = {}
        self._credit: dict[bytes, int] = {}
        self._ring: deque[bytes] = deque()    # clients with requests waiting, in turn order
        self._turn_open = False               # the ring's head has been given this turn's quantum
        self._held: dict[bytes, float] = {}   # client -> not served before this time
        self.waiting = 0

    def __len__(self) -> int:
        return self.waiting

    def push(self, client: bytes, item, cost: int) -> None:
        q = self._queues.get(client)
        if q is None:
            q = self._queues[client] = deque()
            self._credit[client] = 0
            self._ring.append(client)
        q.append((cost, item))
        self.waiting += 1

    def queued(self, client: bytes) -> int:
        """How many of ``client``'s requests wait."""
        q = self._queues.get(client)
        return len(q) if q is not None else 0

    def hold(self, client: bytes, until: float) -> None:
        """Serve none of ``client``'s requests before ``until`` (its next ones included)."""
        self._held[client] = until

    def held_until(self, client: bytes) -> float:
        """Until when ``client`` is held (0.0: not held; a past time: its hold is over)."""
        return self._held.get(client, 0.0)

    def release(self, client: bytes) -> None:
        """Lift ``client``'s hold (it left; a new session may reuse its routing id)."""
        self._held.pop(client, None)

    def next_release(self) -> float | None:
        """When the earliest held client with requests waiting may be served (None: none)."""
        times = [t for c, t in self._held.items() if c in self._queues]
        return min(times) if times else None

    def ready(self, now: float) -> bool:
        """Whether a request waits that ``pop(now)`` would return."""
        return any(self._held.get(c, 0.0) <= now for c in self._ring)

    def pop(self, now: float = 0.0):
        """The next request to serve (FIFO within a client), or None if none may be served now."""
        held_in_a_row = 0                     # every client in the ring held: nothing to serve
        while self._ring and held_in_a_row < len(self._ring):
            client = self._ring[0]
            until = self._held.get(client)
            if until is not None:
                if until > now:                # held: keeps its place, earns no credit
                    self._ring.rotate(-1)
                    self._turn_open = False
                    held_in_a_row += 1
                    continue
                del self._held[client]
            held_in_a_row = 0
            q = self._queues[client]
            if not self._turn_open:
                self._credit[client] += self.quantum
                self._turn_open = True
            cost, item = q[0]
            if cost <= self._credit[client]:
                q.popleft()
                self._credit[client] -= cost
                self.waiting -= 1
                if not q:                     # served out: leaves the ring, forfeits its credit
                    del self._queues[client], self._credit[client]
                    self._ring.popleft()
                    self._turn_open = False
                return item
            self._ring.rotate(-1)             # turn over: the next client's turn
            self._turn_open = False
        return None

    def forget(self, client: bytes) -> int:
        """Drop a client's waiting requests (it left); returns how many."""
        self._held.pop(client, None)
        q = self._queues.pop(client, None)
        if q is None:
            return 0
        del self._credit[client]
        if self._ring and self._ring[0] == client:
            self._turn_open = False
        self._ring.remove(client)
        self.waiting -= len(q)
        return len(q)
