"""Parked fetches: fetches waiting for slots still LOADING, and how each is answered.

A fetch whose plan has slots still loading is parked (``Pending``) under each
of them; it is answered exactly once (``done``):
- with its slots, once the last one is READY (``finished``), after
  ``checked_slots`` confirms that every slot is READY and still holds its key: a
  reply never names a loading or reused slot.  A client that began a new token
  meanwhile (pipelining) has lost the pins the fetch was planned under: the
  slots are pinned again for its current token, within its quota
  (``Store.repin``);
- with ReadFailed when a read it waits on failed (every waiter learns; the next
  fetch retries; a read whose source file changed says so, and no retry helps),
  or ShuttingDown when the daemon cancelled it;
- with NotAttached when the daemon drops its client (``drop``);
- with ShuttingDown at shutdown (``shut_down``).
A client already dropped gets no reply.  A fetch answered with its slots
records its latency (arrival to reply, ``latency.py``).  Every reply tells
``reuse`` that the client has seen the index as it is now (it waited for this
reply, so it read nothing in between).

Partial replies (``fetch`` with ``as_ready``; the loop sets ``as_ready`` around
that one fetch, so the next ``park`` streams): the request's keys already READY
go at once as a part (``{part: [indices], slots: [...]}``), then each batch of
keys whose reads finished in one ``apply_done`` pass goes when the loop calls
``flush`` after it; the final reply is the ordinary one (every slot, in request
order), so a fetch answered at once sends no part.  A part names only slots
pinned under the holder the fetch was planned under, checked like a final
reply.  Parts do not touch ``reuse``: the client's window stays shut until the
final reply (C1), so a part is not a quiescent point.  A client that began a
new token meanwhile gets no more parts (it gave the iteration up); its final
reply is repinned as for any fetch.

Thread: the server thread owns this object; no locking.
"""

from __future__ import annotations

import time

from k3client import errors
from k3client.errors import K3Error, NotAttached
from k3d.cache.slots import READY

SHUTTING_DOWN = "the daemon is shutting down"


class Pending:
    """A parked fetch; ``holder`` is the (client, epoch) its slots were pinned under."""

    __slots__ = ("done", "holder", "keys", "left", "parts", "result", "rid", "session", "slots", "t0")

    def __init__(self, session, rid, keys, slots, left, t0=0.0, result="miss") -> None:
        self.session, self.rid, self.keys, self.slots, self.left = session, rid, keys, slots, left
        self.holder = session.holder
        self.done = False
        self.parts: list[int] | None = None   # streaming: slots ready since the last part; None: not
        self.t0, self.result = t0, result     # arrival time and latency class (k3d/observe/latency.py)


def checked_slots(store, keys, slots) -> list[int]:
    """``slots`` if each is READY and holds its key; else an error naming the first key that is not."""
    for key, slot in zip(keys, slots):
        if store.state[slot] != READY or store.slot_key[slot] != key:
            raise errors.K3Error(
                f"expert (layer {key[0]}, expert {key[1]}) was released before the fetch finished "
                "(begin_token during a fetch?); fetch it again")
    return slots


class Parked:
    def __init__(self, store, replies, source_path: str, latency) -> None:
        self.store, self.replies, self.source_path, self.latency = store, replies, source_path, latency
        self.waiters: dict[int, list[Pending]] = {}      # LOADING slot -> fetches parked on it
        self.as_ready = False    # set by the loop around a fetch that asked for partial replies
        self._streams: dict[int, Pending] = {}           # id -> streaming fetch with a part to send

    def park(self, session, rid, keys, slots, waiting: set[int], t0: float, result: str) -> None:
        """Park a fetch that arrived at ``t0`` (its latency class ``result``) on ``waiting``;
        with ``as_ready``, its keys READY now go at once as the first part."""
        p = Pending(session, rid, keys, slots, set(waiting), t0, result)
        for slot in waiting:
            self.waiters.setdefault(slot, []).append(p)
        if self.as_ready:
            p.parts = [slot for slot in slots if slot not in waiting]
            self._part(p)

    def flush(self) -> None:
        """Send each streaming fetch the part its reads finished since the last one (the
        loop calls this after ``apply_done``: one part per fetch per pass, not per read)."""
        if not self._streams:
            return
        streams, self._streams = self._streams, {}
        for p in streams.values():
            if not p.done:
                self._part(p)

    def _part(self, p: Pending) -> None:
        ready, p.parts = set(p.parts or ()), []
        if not ready or not p.session.alive or p.session.holder != p.holder:
            return       # nothing new; or nobody reads it: gone, or on to its next token
        at = [i for i, slot in enumerate(p.slots) if slot in ready]
        try:
            slots = checked_slots(self.store, [p.keys[i] for i in at], [p.slots[i] for i in at])
        except K3Error as e:
            p.done = True
            self._error(p, e)
            return
        self.replies.ok(p.session.routing, p.rid, {"part": at, "slots": slots})

    def finished(self, load, cancelled: bool) -> None:
        """``load``'s slot left LOADING (READY, or FREE if ``load.fail``): answer who waited."""
        for p in self.waiters.pop(load.slot, ()):
            if p.done:
                continue
            if load.fail:
                p.done = True
                if p.session.alive and cancelled:   # the client re-attaches after a restart
                    self._error(p, errors.ShuttingDown(SHUTTING_DOWN))
                elif p.session.alive and load.stale:     # no retry helps: the file changed
                    self._error(p, errors.ReadFailed(
                        f"expert (layer {load.key[0]}, expert {load.key[1]}): {load.fail}"))
                elif p.session.alive:
                    self._error(p, errors.ReadFailed(
                        f"reading expert (layer {load.key[0]}, expert {load.key[1]}) from "
                        f"{self.source_path} failed: {load.fail}; the next fetch retries"))
                continue
            p.left.discard(load.slot)
            if not p.left:
                p.done = True
                if p.session.alive:
                    self._answer(p)
            elif p.parts is not None:
                p.parts.append(load.slot)
                self._streams[id(p)] = p

    def _answer(self, p: Pending) -> None:
        try:
            slots = checked_slots(self.store, p.keys, p.slots)
            if p.session.holder != p.holder:
                if not self.store.reuse.awaited(p.session.client_id, p.rid):
                    # A hit-path client that began a token after this request gave up
                    # on it (k3client waits for every reply): pinning it in the new
                    # token would count against the quota the client counts itself.
                    raise errors.K3Error("fetch answered after this client began a new token "
                                         "and sent other requests; fetch again")
                # The client began a new token before this reply (a pipelining
                # client): its old pins are gone, so pin for the token it reads in,
                # within that token's quota like any fetch in it.
                self.store.repin(p.session.holder, slots)
            self.answer(p.session, p.rid, slots, p.t0, p.result)
        except K3Error as e:
            self._error(p, e)

    def answer(self, session, rid: int, slots: list[int], t0: float, result: str) -> None:
        """Send a fetch's ``slots`` (checked) to ``session``, parked or answered at once:
        its latency counts to now, and the reply is the client's quiescent point for
        deferred reuse (``reuse.replied``).  The loop marks that for the ops it answers;
        a fetch replies here, so here is the one place it is marked for a fetch."""
        self.replies.ok(session.routing, rid, {"slots": slots})
        now = time.monotonic()
        self.latency.record(result, now - t0)
        self.store.reuse.replied(session.client_id, rid, ok=True)

    def drop(self, session, reason: str) -> None:
        """The daemon dropped ``session``: a fetch it still waits on is answered now (a live
        process whose lease ran out must not wait for its own timeout to learn it)."""
        for p in {id(p): p for ps in self.waiters.values() for p in ps}.values():
            if p.session is session and not p.done:
                p.done = True
                self._error(p, NotAttached(
                    f"the daemon dropped this client ({reason}) before the fetch finished; "
                    "its pins are released: connect again"))

    def shut_down(self) -> None:
        """Answer every fetch still parked with ShuttingDown."""
        for waiting in self.waiters.values():
            for p in waiting:
                if not p.done and p.session.alive:
                    p.done = True
                    self._error(p, errors.ShuttingDown(SHUTTING_DOWN))
        self.waiters.clear()

    def _error(self, p: Pending, e: K3Error) -> None:
        self.replies.error(p.session.routing, p.rid, e)
        self.store.reuse.replied(p.session.client_id, p.rid, ok=False)
