"""Deferred reuse: an evicted slot is rewritten only when no client can still read it.

Clients answer hits themselves from the shared index (``k3client.index``) and
report them later, in order, on their one request socket.  So when the daemon
evicts a slot (clears its key's index entry), a client may have looked it up
just before and still hold a view of it.  The slot leaves the cache at once (its
key is gone, the policy forgets it), but its memory goes back to the free list
only when this module says so.  The scheme is epoch-based reclamation (Fraser;
RCU's grace periods), with the clients' messages as the quiescent points.

The guarantee (what ``k3client`` promises its caller): a view, however it was
answered, keeps its bytes until the client's next ``begin_token()``, its release
of that view's layer (``release_layer``: protocol 6 ``done``), or ``close()``,
with no time bound while the process lives.  A client that dies, or
stops heartbeating for its lease, loses everything (``sessions.py``).

The client's obligations (``k3client/hits.py``; the model test plays them):
- C1. It answers a fetch itself only while its *window* is open: opened by a
  successful reply to the last request it sent, closed when it sends a request,
  and kept closed by any failure (timeout, interrupt, error reply, re-attach).
- C2. Every lookup it answers is reported, in order, in the next message it
  sends on its request socket (a request, or ``hits``); a ``hits`` message may
  carry ``seen``: the index's retirement count, read after taking the reports
  (the lease thread sends one when the client is idle, so a long hold does not
  hold back reuse).
- C3. It answers no more slots in a token than its pin quota.
- C4. It releases a layer (``done``) only once it reads no view of that layer
  from this token again; a lookup of the layer answered after the release was
  queued and before it left cancels it (``LocalHits.answer``), so a message's
  ``done`` never covers a report of a lookup made after it.

What the daemon knows of each hit-path client (``Viewer``):
- ``synced``: a lower bound on the retirement count of any slot the client may
  hold a view of that is neither pinned nor claimed for it.  ``INF`` while a
  request it sent is handled or failed (C1: its window is closed, so every view
  it holds was reported, hence pinned or claimed); the retirement count when the
  reply to its latest request leaves; raised to ``seen`` by a ``hits`` message.
- ``pending``: the id of its latest request, until answered: only that reply
  moves ``synced`` (a late reply to a request it gave up on must not: it may
  have opened its window on a later one, and looked up since).
- ``claims``: slots it reported reading this token whose key had left by then
  (``cache/reported.py``), each with the layer of the key reported; they count
  toward its pin quota and are dropped at its next token, or at its release of
  that layer.  A claim must be a slot the client could have read: waiting here,
  retired after the client's ``synced`` before the message; anything else is a
  garbage report, refused and counted.

Rule: slot ``s``, retired as count ``r``, is reusable when for every hit-path
client ``c``: ``s`` is not in ``c.claims`` and ``c.synced >= r``.

Liveness: an honest client's ``synced`` passes every count within a heartbeat
(its lease thread reports ``seen`` whenever the count moved) or it is blocked
in a request (``INF``).  A client still below the count of a slot that has
waited for longer than its lease is not doing that (a bug, or a client holding
everyone's reuse back on purpose): ``lagging`` names it and the server drops
it, as it drops a client that stops heartbeating.

Invariant: a slot a client may still read (a view in its current token) is not
free.  Proof sketch: ``c`` read ``s`` holding key ``k`` by a lookup ``L``.  If
the daemon cleared ``k``'s entry before ``L``'s loads (in the writer's store
order; TSO), ``c`` saw 0 or an odd seq, not ``s``.  Else ``s`` retires later as
some ``r``.  ``L`` happened in an open window, i.e. after ``c`` received the reply
``R`` to its latest request, sent when the count was ``r_R`` (so ``r > r_R``:
the clear followed ``L``, which followed ``R``), or after a ``hits`` message's
``seen`` read (``r > seen``).  ``synced`` holds ``r_R`` or ``seen`` from then on
until ``c``'s next message ``M`` is handled (a stale reply cannot raise it:
``pending``), and ``M`` carries the report of ``L`` (C2, one socket, FIFO).
Handling ``M`` applies its reports before anything else: ``k`` still at ``s`` is
pinned for ``c``'s token; ``k`` gone means ``s`` waits here with ``r > synced``,
so it is claimed.  Only then may ``synced`` move (``INF`` for a request: C1
says ``c`` looks nothing up until its reply, whose count covers every later
lookup; ``seen`` for a ``hits``: every lookup after it reads entries after that
count).  Pins and claims last until ``c``'s next token, when the view ends, or
until a message of ``c``'s whose ``done`` names ``k``'s layer is handled, after
its reports: by C4 that release was queued after ``L``, and ``c`` reads the view
no more; a lookup of the layer after it went is reported in a later message,
handled after the ``done``, and pinned or claimed afresh.
A timeout or interrupt leaves ``c``'s window closed (C1): it reads nothing new,
and what it read was reported in the request it gave up on.  A re-attach is a
new session; the old one's views are of the old arena's mapping.

Pure: no clock, no I/O; the server thread owns it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

INF = float("inf")


def reserve_for(slots: int) -> int:
    """Slots the store keeps free or waiting while several clients answer hits themselves
    (``Store.make_room``), so that a miss finds one without waiting for the others'
    next messages."""
    return min(slots // 4, max(4, slots // 16))


@dataclass
class Viewer:
    synced: float = 0
    pending: int | None = None        # id of the latest request, until its reply
    before: float = 0                 # ``synced`` when that request came: what its reports may claim
    claims: set[int] = field(default_factory=set)
    claimed_layer: dict[int, int] = field(default_factory=dict)    # claimed slot -> layer of its report


class Reuse:
    def __init__(self):
        self.retired = 0                          # count of retirements (the index's header)
        self.viewers: dict[int, Viewer] = {}      # hit-path clients
        self.limbo: dict[int, int] = {}           # slot -> its retirement count
        self.since: dict[int, float] = {}         # slot -> when it began to wait
        self.peak = 0

    # -- clients ----------------------------------------------------------------
    def attach(self, client: int) -> None:
        """A hit-path client said hello: it has seen every retirement so far."""
        self.viewers[client] = Viewer(self.retired)

    def leave(self, client: int) -> None:
        self.viewers.pop(client, None)

    def waiting(self, client: int, rid) -> None:
        """The daemon handles request ``rid`` of ``client``, after its reports: the client
        looks nothing up until that request's reply (C1)."""
        r = self.viewers.get(client)
        if r is not None:
            r.before = r.synced if r.pending is None else r.before
            r.pending, r.synced = rid, INF

    def replied(self, client: int, rid, ok: bool) -> None:
        """The reply to request ``rid`` left.  Only the reply to the latest request moves
        the client's sync point, and only a success (a failure keeps its window shut)."""
        r = self.viewers.get(client)
        if r is not None and r.pending == rid:
            r.pending = None
            if ok:
                r.synced = self.retired

    def awaited(self, client: int, rid) -> bool:
        """Whether ``client`` may still wait for request ``rid``: not a hit-path client, or
        ``rid`` is its latest request (a later one means it gave up on ``rid``: C1)."""
        r = self.viewers.get(client)
        return r is None or r.pending == rid

    def seen(self, client: int, count) -> bool:
        """A ``hits`` message said the client read the retirement count ``count`` after
        taking its reports (applied just before): later lookups see every clear up to it.
        False: not a count this daemon has reached (a garbage report)."""
        r = self.viewers.get(client)
        if r is None:
            return True
        if type(count) is not int or not 0 <= count <= self.retired:
            return False
        if r.synced != INF:
            r.synced = max(r.synced, count)
        return True

    def claimable(self, client: int, slot: int) -> bool:
        """Whether ``client`` could have read ``slot`` in its window: the slot waits for
        reuse, retired after the client's sync point before this message (or is claimed)."""
        r = self.viewers.get(client)
        if r is None:
            return False
        floor = r.before if r.pending is not None else r.synced
        return slot in r.claims or self.limbo.get(slot, -1) > floor

    def claim(self, client: int, slot: int, layer: int = -1) -> bool:
        """Keep ``slot`` from reuse until ``client``'s next token, or its release of
        ``layer`` (the layer of the key it reported there); False (refused) when it could
        not have read it."""
        if not self.claimable(client, slot):
            return False
        r = self.viewers[client]
        r.claims.add(slot)
        r.claimed_layer[slot] = layer
        return True

    def release_layers(self, client: int, layers) -> int:
        """``client`` is done with ``layers`` for this token: its claims of slots it reported
        under them end (the slots may be reused once no one else holds them); returns how many."""
        r = self.viewers.get(client)
        if r is None or not r.claims:
            return 0
        gone = [s for s, layer in r.claimed_layer.items() if layer in layers]
        for s in gone:
            r.claims.discard(s)
            del r.claimed_layer[s]
        return len(gone)

    def claims(self, client: int) -> set[int]:
        r = self.viewers.get(client)
        return r.claims if r is not None else set()

    def new_token(self, client: int) -> None:
        r = self.viewers.get(client)
        if r is not None:
            r.claims.clear()
            r.claimed_layer.clear()

    # -- slots --------------------------------------------------------------------
    def unpublished(self) -> None:
        """A key left the index that no client could have read (it was never READY): the
        count moves with the index's, whose header clients report as ``seen``; no slot waits."""
        self.retired += 1

    def retire(self, slot: int, now: float = 0.0) -> bool:
        """``slot``'s key left the index.  True: reuse it now; False: it waits (``reclaim``)."""
        self.retired += 1
        count, viewers = self.retired, self.viewers
        # ``_free_now`` of one slot, without the union of every client's claims that it
        # builds for a batch (an eviction ahead runs this for each slot it frees)
        if all(r.synced >= count and slot not in r.claims for r in viewers.values()):
            return True                                  # (no viewers: replay, one client)
        self.limbo[slot] = self.retired
        self.since[slot] = now
        self.peak = max(self.peak, len(self.limbo))
        return False

    def reclaim(self) -> list[int]:
        """The waiting slots no client can read any more (removed from the wait)."""
        if not self.limbo:
            return []
        out = self._free_now(list(self.limbo.items()))
        for s in out:
            del self.limbo[s]
            del self.since[s]
        return out

    def lagging(self, before: float) -> list[int]:
        """Clients whose sync point is still below the count of a slot waiting since
        before ``before`` (not ``INF``: a client blocked in a request reads nothing)."""
        old = [self.limbo[s] for s, t in self.since.items() if t < before]
        if not old:
            return []
        oldest = min(old)
        return [c for c, r in self.viewers.items() if r.synced < oldest]

    def coming(self) -> int:
        """Waiting slots no client claims: each is free once the clients' sync points pass
        it (a claimed one waits for its claimant's next token, which may be far)."""
        if not self.limbo:
            return 0
        claimed = set().union(*(r.claims for r in self.viewers.values()))
        return len(self.limbo.keys() - claimed)

    def could_reuse_now(self) -> bool:
        """Whether a slot retired now would be reusable at once (no client is reading)."""
        return all(r.synced == INF for r in self.viewers.values())

    def holders(self) -> list[int]:
        """Clients that keep some waiting slot from reuse (status, and CacheFull's message)."""
        if not self.limbo:
            return []
        oldest = min(self.limbo.values())
        return [c for c, r in self.viewers.items() if r.synced < oldest or r.claims & self.limbo.keys()]

    def _free_now(self, waiting: list[tuple[int, int]]) -> list[int]:
        floor, claimed = INF, set()
        for r in self.viewers.values():
            floor = min(floor, r.synced)
            claimed |= r.claims
        return [s for s, count in waiting if count <= floor and s not in claimed]
