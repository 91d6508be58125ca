"""The protocol's ops: one small handler per op (``op_*``); its docstring is the spec.

The docs show these docstrings as the protocol reference (``docs/hooks/reference.py``,
``<!-- k3d:ops -->``); ``k3client/protocol.py`` is the client's side of the schema.
A handler is ``(session, routing, msg, frame, t0) -> result``: the session of the
sender (None before hello), its ROUTER identity, the decoded request, the raw frame
(the ipc peer's credentials), and when it arrived.  It returns the reply's fields,
``DEFERRED`` (it replied itself, or parked the request to reply later) or
``NO_REPLY`` (heartbeat, hits).  It raises a ``K3Error`` for a refusal: the loop's
``_handle`` (``k3d.serve.loop``) is the one place that turns exceptions into error
replies, so nothing a client sends can stop the loop.  Each handler makes one call
into the fetch service (``cache/fetch.py``) with the client's session.

Hits mostly never get here: clients answer fetches of resident experts from the
shared index (``memory/index.py``) and report them with their next message.  A
request's reports are applied before anything of the request can fail
(``_reports``, first in every handler that takes them); the reply to a hit-path
client's latest request (``_handle``, or ``parked`` for a fetch) and a ``hits``
message's ``seen`` are its quiescent points for the deferred reuse of evicted
slots (``cache/reuse.py``).

Owner: the server thread, as the loop (``Ops`` keeps references to the loop's
parts, never state of its own).  Caller's obligation: one call at a time, with
the session ``Sessions`` gives for ``routing``.
"""

from __future__ import annotations

import logging
import time

from k3client.errors import BadRequest, NotAttached
from k3d.cache.sessions import Session, identify
from k3d.serve import wire
from k3d.serve.access import admit, peer_cred

log = logging.getLogger("k3d")

DEFERRED = object()      # the handler replied itself, or parked the request to reply later
NO_REPLY = object()      # heartbeat, hits: nothing to send
ASYNC_OPS = frozenset(("heartbeat", "hits"))   # the client does not wait for these


class Ops:
    """The handlers, over the loop's parts (``Server`` builds one and looks ops up in ``by_name``)."""

    def __init__(self, *, gen: int, source, arena, arena_socket: str, index, live, store, cache,
                 sessions, stats, drop, status):
        """``drop(session, reason, dead)`` and ``status()`` are the loop's (a client's
        leaving, the status dict); the rest are the loop's parts, shared, never copied."""
        self.gen, self.source, self.arena, self.arena_socket = gen, source, arena, arena_socket
        self.index, self.live, self.store, self.cache = index, live, store, cache
        self.sessions, self.stats = sessions, stats
        self._drop, self.status = drop, status
        self.by_name = {name[3:]: getattr(self, name) for name in dir(self) if name.startswith("op_")}

    def refuse(self, s, routing, msg, frame, t0):
        """Any op but ``heartbeat`` over the cap: its hit reports are applied (the client's
        views depend on them); then a ``hits`` message is done, and anything else is
        refused in one line.  The client's sync point (``cache/reuse.py``) stays where it
        is: no ``waiting``, no reply that moves it, and a ``seen`` is ignored, since its
        earlier messages still wait with reports of lookups made before that count."""
        if s is not None and (msg.get("hits") is not None or msg.get("done") is not None):
            self._reports(s, msg, time.monotonic())
        if msg.get("op") == "hits":
            return NO_REPLY
        raise BadRequest(f"more than {wire.MAX_QUEUED} requests queued from this client; "
                         "wait for replies before sending more")

    def _keys(self, msg: dict, field: str, unique: bool) -> list[tuple[int, int]]:
        return wire.keys(msg, field, unique, self.source)

    def _hits(self, msg: dict):
        return wire.hits(msg, self.source, self.arena.slots)

    def _reports(self, s: Session, msg: dict, now: float) -> None:
        """The message's hit reports, then its ``done`` layers (protocol 6): a report may
        name a layer the same message releases (the client read it before it was done)."""
        if "hits" not in msg and "done" not in msg:    # (most fetches: nothing to apply)
            return
        self.cache.report(s, self._hits(msg), now)
        done, bad = wire.done(msg, self.source)
        if done:
            self.cache.done(s, done, now)
        if bad:
            raise BadRequest(bad)

    @staticmethod
    def _attached(s: Session | None) -> Session:
        if s is None:
            raise NotAttached("send hello first (k3client.connect does this); or the daemon dropped this client")
        return s

    # -- ops -----------------------------------------------------------------
    def op_hello(self, s, routing, msg, frame, t0):
        """hello {name: str, pid: int, hit_path?: bool} -> {client_id, layout, arena_socket, ...}.

        First message of every client.  Identifies the process (the ipc peer pid
        wins over the one the client claims) for liveness checks, starts epoch 0,
        and returns the layout and where to get the arena and index fds.  A client
        with ``hit_path`` answers hits itself from the shared index and reports them."""
        name, pid = admit(msg, frame)
        pid, started = identify(pid)
        if s is not None:
            self._drop(s, "said hello again", dead=False)
        now = time.monotonic()
        s = self.sessions.attach(routing, name, pid, started, now, self.live.lease_s)
        s.pin_quota = self.live.pin_quota
        s.hit_path = msg.get("hit_path") is True
        if s.hit_path:
            self.store.reuse.attach(s.client_id)
        log.info("client %s (pid %s) attached as #%d%s", s.name, pid, s.client_id,
                 "" if s.hit_path else ", every fetch through the daemon")
        return {"client_id": s.client_id, "layout": [t.to_wire() for t in self.source.layout],
                "slots": self.arena.slots, "slot_bytes": self.arena.slot_bytes,
                "expert_bytes": self.source.expert_bytes, "arena_bytes": self.arena.size,
                "arena_socket": self.arena_socket, "lease_s": self.live.lease_s, "index_bytes": self.index.size,
                "pin_quota": s.pin_quota,
                "model": self.source.describe()}

    def op_fetch(self, s, routing, msg, frame, t0):
        """fetch {keys: [[layer, expert], ...], predicted?: [[l, e], ...], hits?: [...],
        as_ready?: bool} -> {slots: [...]}, after parts {part: [indices], slots: [...]} with ``as_ready``.

        ``hits`` first: fetches the client answered itself (``[layer, [experts],
        [slots seen]]`` each, in order), applied as hits; then ``done`` (protocol 6):
        layers the client is done with this token, whose pins and claims go
        (``cache/fetch.py``; also read by ``hits``, ``predict`` and ``status``).  Then the keys: hits are
        touched and pinned under (client, epoch); keys being read are waited on
        (hit + waited); misses take free or evicted slots and are read URGENT, split
        into parts across readers.  Replies once every key is ready, slots in
        request order.  ``predicted`` is handled as ``predict`` after the fetch is
        planned (ignored with ``--predict off``); then, with ``--predict auto``, the
        daemon's own predictions fill what is left of the fetch's prediction budget.
        With ``as_ready``, a fetch that waits for reads first sends the keys READY now,
        then each batch of keys as their reads finish, as parts (``part``: indices into
        ``keys``; ``slots``: theirs), each pinned as the final reply's are; the final
        reply is as without it (``cache/parked.py``).
        Errors: cache full (nothing changes), slots busy (retry),
        quota, unknown or duplicate keys, a failed read."""
        s = self._attached(s)
        self._reports(s, msg, time.monotonic())     # first: nothing below may lose them
        keys = self._keys(msg, "keys", unique=True)
        if not keys:
            raise BadRequest("fetch of zero keys")
        as_ready = msg.get("as_ready", False)
        if type(as_ready) is not bool:
            raise BadRequest(f"as_ready must be true or false, not {str(as_ready)[:40]}")
        predicted = self._keys(msg, "predicted", unique=False) if msg.get("predicted") is not None else []
        self.cache.parked.as_ready = as_ready
        try:
            self.cache.fetch(s, msg["id"], keys, predicted, [], t0)
        finally:
            self.cache.parked.as_ready = False
        return DEFERRED

    def op_hits(self, s, routing, msg, frame, t0):
        """hits {hits: [...], seen?: int, done?: [layer, ...]} -> no reply.

        A client that answered many fetches itself reports them (as ``fetch``'s
        ``hits``) without waiting for its next request.  ``seen``: the index's
        retirement count the client read after taking these reports (its lease
        thread sends one while it computes): slots retired up to it may be reused
        unless these reports pinned or claimed them (``k3d/cache/reuse.py``)."""
        s = self._attached(s)
        self._reports(s, msg, time.monotonic())
        if "seen" in msg and s.hit_path and not self.store.reuse.seen(s.client_id, msg["seen"]):
            self.stats.bad_reports += 1
            raise BadRequest(f"hits: seen {str(msg['seen'])[:40]} is not a retirement count of this index")
        return NO_REPLY

    def op_predict(self, s, routing, msg, frame, t0):
        """predict {keys: [[layer, expert], ...], hits?: [...]} -> {queued: int}, at once.

        Keys not resident get slots while one is free or evictable (stopping at
        the first that is not) and are read BACKGROUND, behind every urgent
        read.  Unfetched by the predictor's next begin_token, they count
        prefetch_unused and are demoted.  With a pin quota, the prediction
        throttle of ``cache/fetch.py`` applies."""
        s = self._attached(s)
        now = time.monotonic()
        self._reports(s, msg, now)
        return {"queued": self.cache.predict(s, self._keys(msg, "keys", unique=False), now)}

    def op_begin_token(self, s, routing, msg, frame, t0):
        """begin_token {hits?: [...]} -> {epoch, released}: next epoch; the previous epoch's pins go
        (a ``done`` here is ignored: every pin of the epoch goes)."""
        s = self._attached(s)
        released = self.cache.begin_token(s, self._hits(msg))
        return {"epoch": s.epoch, "released": released}

    def op_heartbeat(self, s, routing, msg, frame, t0):
        """heartbeat {client_id, gen?} -> no reply; renews the lease of a client the sender owns.

        One sent from another process than the client's (ipc peer credentials)
        renews nothing and counts as a bad request.  A heartbeat for another
        generation (queued while this daemon was restarting) is ignored: its
        client_id names someone else here."""
        if msg.get("gen", self.gen) == self.gen:
            client_id = msg.get("client_id")
            if not self.sessions.heartbeat(client_id, peer_cred(frame)[2], time.monotonic()) \
                    and type(client_id) is int and client_id in self.sessions.by_id:
                self.stats.bad_requests += 1
        return NO_REPLY

    def op_status(self, s, routing, msg, frame, t0):
        """status {hits?} -> {status: {...}}; needs no hello (k3ctl uses it).  An attached
        client's reports are applied first, so its status counts its own hits."""
        if s is not None:
            self._reports(s, msg, time.monotonic())
        return {"status": self.status()}

    def op_bye(self, s, routing, msg, frame, t0):
        """bye {hits?: [...]} -> {}: the client leaves (after its last reports); its pins and
        predictions are released."""
        if s is not None:
            self.cache.report(s, self._hits(msg), time.monotonic())
            self._drop(s, "said bye", dead=False)
        return {}
