"""Deferred reuse: an evicted slot is rewritten only when no client can still read it.

Clients answer hits themselves from the shared index (``k3client.index``) and
report them in their next message.  So when the daemon evicts a slot (clears its
key's index entry), a client may have looked it up just before and still hold a
view of it.  The slot leaves the cache at once (its key is gone, the policy
forgets it), but its memory goes back to the free list only when this module
says so.  The scheme is epoch-based reclamation (Fraser; RCU's grace periods),
with the clients' replies as the quiescent points.

What it knows of each hit-path client (one that answers hits itself):
- ``synced``: the retirement count the client has certainly seen.  Set to the
  daemon's count when it sends the client a reply to a request the client waits
  for (the kernel orders the daemon's earlier stores before the client's later
  loads); ``INF`` while such a request is being handled, since the client, blocked
  on it, looks nothing up.  A fetch answered ``SlotsBusy`` leaves it ``INF``
  until the client's next request: the client retries, and answers no hit
  itself until a later request's reply (``k3client``'s obligation: it closes its
  window, ``LocalHits.t_req``, when it gives up).  Else several clients near the
  arena's floor wait on each other's backoff sleeps: each one's evicted slots
  wait for the others' next requests, which they send only when their own
  backoff ends (the demo's three clients at 102 slots: p99 ~1 s, 4,586 retries
  in 1,440 fetches; with this rule, 17 ms and 505).
- ``t_sync``: when that reply was sent.  The pin rule for hits the client answers
  itself: a view is valid until its next ``begin_token`` or until ``lease`` after
  the request before it (``k3client`` answers hits itself only in the first half
  of that).  After ``t_sync + lease`` nothing it read before is in use.
- ``claims``: slots it reported reading this token that are not pinned for it
  (the key had already left, or its pin quota was full); dropped at its next
  token or at ``t_sync + lease``.

Rule: slot ``s``, retired as count ``r``, is reusable when for every hit-path
client ``c``: ``s`` is not in ``c.claims``, and ``c.synced >= r`` or
``now >= c.t_sync + lease``.  With one client, which is blocked in the request
that evicts, that is at once, so a single client sees the same slots, counters
and trace as with the round trip.

Invariant: a slot a client may still read (a view it answered itself, in its
current token, within its lease) is not free.  Proof sketch: ``c`` read ``s``
holding key ``k`` at ``t``.  If the daemon cleared ``k``'s entry before that load
(in the writer's store order), ``c`` saw 0 or an odd seq, not ``s``.  Else
``s`` retires later as some ``r`` above every count ``c`` had seen at ``t``.
Until the daemon handles ``c``'s next request ``M``, ``c.synced < r`` (its last
reply preceded the read) and only ``t_sync + lease``, the end of the view, can
free ``s``.  ``M`` carries every hit ``c`` answered before sending it, so the
daemon handles the report of (``k``, ``s``) before ``c.synced`` moves on:
``k`` still at ``s`` is pinned for ``c`` (or claimed, over quota), so not
evicted; ``k`` gone is claimed.  Pins and claims last until ``c``'s next token.
If ``M`` is answered ``SlotsBusy``, its reports were applied all the same (they
go first), ``c.synced`` stays ``INF``, and ``c`` reads nothing until it sends
its next request, whose reply sets ``c.synced`` again: ``c`` looks nothing up
while ``INF`` says so.

Pure: no clock (``now`` is passed in), no I/O; the server thread owns it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

INF = float("inf")


def reserve_for(slots: int) -> int:
    """Slots the store keeps free or waiting while several clients answer hits themselves
    (``Store.make_room``), so that a miss finds one without waiting for the others'
    next requests."""
    return min(slots // 4, max(4, slots // 16))


@dataclass
class Reader:
    lease: float                  # the lease the client was told at hello
    synced: float = 0
    t_sync: float = 0.0
    claims: set[int] = field(default_factory=set)


class Reuse:
    def __init__(self):
        self.retired = 0                          # count of retirements (the index's header)
        self.readers: dict[int, Reader] = {}      # hit-path clients
        self.limbo: dict[int, int] = {}           # slot -> its retirement count
        self.peak = 0

    # -- clients ----------------------------------------------------------------
    def attach(self, client: int, now: float, lease: float) -> None:
        """A hit-path client said hello: it has seen every retirement so far."""
        self.readers[client] = Reader(lease, self.retired, now)

    def leave(self, client: int) -> None:
        self.readers.pop(client, None)

    def waiting(self, client: int) -> None:
        """The daemon handles a request ``client`` waits for: it reads nothing meanwhile."""
        r = self.readers.get(client)
        if r is not None:
            r.synced = INF

    def replied(self, client: int, now: float) -> None:
        """The reply to that request left: the client has seen every retirement so far."""
        r = self.readers.get(client)
        if r is not None:
            r.synced, r.t_sync = self.retired, now

    def claim(self, client: int, slot: int) -> None:
        r = self.readers.get(client)
        if r is not None:
            r.claims.add(slot)

    def new_token(self, client: int) -> None:
        r = self.readers.get(client)
        if r is not None:
            r.claims.clear()

    # -- slots --------------------------------------------------------------------
    def retire(self, slot: int, now: float) -> bool:
        """``slot``'s key left the index.  True: reuse it now; False: it waits (``reclaim``)."""
        self.retired += 1
        if not self.readers or self._free_now([(slot, self.retired)], now):     # (none: replay, one client)
            return True
        self.limbo[slot] = self.retired
        self.peak = max(self.peak, len(self.limbo))
        return False

    def reclaim(self, now: float) -> list[int]:
        """The waiting slots no client can read any more (removed from the wait)."""
        if not self.limbo:
            return []
        out = self._free_now(list(self.limbo.items()), now)
        for s in out:
            del self.limbo[s]
        return out

    def could_reuse_now(self, now: float) -> bool:
        """Whether a slot retired now would be reusable at once (no client is reading)."""
        return all(r.synced == INF or now >= r.t_sync + r.lease for r in self.readers.values())

    def holders(self, now: float) -> list[int]:
        """Clients that keep some waiting slot from reuse (status, and CacheFull's message)."""
        if not self.limbo:
            return []
        oldest = min(self.limbo.values())
        return [c for c, r in self.readers.items()
                if now < r.t_sync + r.lease and (r.synced < oldest or r.claims & self.limbo.keys())]

    def _free_now(self, waiting: list[tuple[int, int]], now: float) -> list[int]:
        floor, claimed = INF, set()
        for r in self.readers.values():
            if now >= r.t_sync + r.lease:
                r.claims.clear()                  # its views ended with its lease
                continue
            floor = min(floor, r.synced)
            claimed |= r.claims
        return [s for s, count in waiting if count <= floor and s not in claimed]
