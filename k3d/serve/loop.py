"""The server loop: one thread owns the ROUTER socket, the store and the policy.

Loop (``serve_forever``): wait for a request or a finished read; handle the next
request in turn, apply every finished read, publish a status snapshot when
``/metrics`` asked for one (other threads never read the store), then
housekeeping (dead clients, views whose lease ended, systemd status and
watchdog).  Nothing in the loop waits on I/O: a fetch that misses starts reads
and is parked until its slots are ready, while other clients are answered.

How it waits: while a read is in flight or a request waits its turn, it polls
the ROUTER socket beside the reader pool's eventfd.  Otherwise nothing but a
message can need it, so it waits in a blocking receive on the ROUTER alone,
which costs a request several times less CPU than a poll does (bench/README.md,
"the loop's own cost").  What must wake it then sends a message: ``_wake``
(stop, reload, a ``/metrics`` scrape) through ``wire.Waker``; housekeeping runs
at least every ``intake.IDLE_MS``.  The arena hand-out has its own thread
(``handout.py``), which touches nothing the loop owns.

One small handler per op (``op_*``); its docstring is the spec.  ``_handle`` is
the one place that turns exceptions into error replies; nothing a client sends
can stop the loop.  Each handler makes one call into the fetch service
(``cache/fetch.py``) with the client's session, looked up once per request.

Hits mostly never get here: clients answer fetches of resident experts from the
shared index (``memory/index.py``) and report them with their next message.  A
request's reports are applied before anything of the request can fail; the reply
to a hit-path client's latest request (``_handle``, or ``parked`` for a fetch)
and a ``hits`` message's ``seen`` are its quiescent points for the deferred reuse
of evicted slots (``cache/reuse.py``).

Who does what (all on this thread; reader threads only fill slot memory):
- ``wire``: the ROUTER socket, request decoding, key and report checks, replies;
- ``intake``: requests off the socket into ``turns`` (deficit round-robin
  between clients, so a flood of big requests cannot starve small ones) and, with
  ``--max-share``, each client's CPU charged to ``pacing`` (a client far over
  its share is held back before its next request);
- ``cache/sessions``: attached clients and their liveness;
- ``cache/fetch``: the fetch service, keeping ``store``, ``reads`` and
  ``parked`` in step;
- ``handout``: the arena and index fds over the Unix socket (its own thread);
- ``observe/status``, ``reload``: what status shows; what SIGHUP may change.

Signals: the CLI's handlers only call ``request_stop`` / ``request_reload``
(set a flag and wake the loop); the loop acts.  Stop drains: stop
accepting, cancel queued reads, wait for running ones, answer parked fetches
with an error, release the arena.

Access: only the daemon's uid, root or its group, checked from kernel credentials
on hello and on the arena socket (``access.py``).
"""

from __future__ import annotations

import logging
import os
import random
import time

import zmq

from k3client.endpoint import ipc_path
from k3client.errors import (
    BadRequest,
    K3Error,
    NotAttached,
    ProtocolMismatch,
    UnknownExpert,
)
from k3d.cache.fetch import FetchService
from k3d.cache.policy import make as make_policy
from k3d.cache.predict import DEFAULT as PREDICT_DEFAULT, AutoPrefetch, make as make_predictor
from k3d.cache.reuse import Reuse, reserve_for
from k3d.cache.sessions import REAP_INTERVAL, Session, Sessions, identify
from k3d.cache.store import Store
from k3d.cache.warm import WarmState
from k3d.config import Live
from k3d.memory.index import SharedIndex
from k3d.observe import status as status_view
from k3d.observe.latency import FetchLatency
from k3d.observe.metrics import SnapshotBoard
from k3d.observe.trace import RouteTrace
from k3d.serve import reload, wire
from k3d.serve.access import admit, peer_cred, private_umask
from k3d.serve.handout import ArenaHandout
from k3d.serve.intake import IDLE_MS, Intake

log = logging.getLogger("k3d")

DEFERRED = object()      # the handler replied itself, or parked the request to reply later
NO_REPLY = object()      # heartbeat, hits: nothing to send
ASYNC_OPS = frozenset(("heartbeat", "hits"))   # the client does not wait for these
STATUS_INTERVAL = 5.0    # seconds between systemd STATUS= lines


class Server:
    def __init__(self, cfg, source, arena, arena_socket: str, notifier=None, board=None, sock=None):
        """``sock``: the endpoint's ROUTER socket, already bound (the daemon binds it before
        the arena is built, so that it answers status while starting); None: bind it here."""
        self.cfg, self.source, self.arena = cfg, source, arena
        self.notifier = notifier
        self.t0 = time.monotonic()
        self.gen = random.getrandbits(62) | 1
        layers = 1 + max(l for l, _ in source.keys)
        self.index = SharedIndex(layers, 1 + max(e for _, e in source.keys))
        # SIGHUP's settings, read by every component from this one object (reload.apply updates it)
        self.live = Live.of(cfg, RouteTrace(cfg.trace, self.t0) if cfg.trace else None)
        # (a read costs a slot's bytes, fixed with the arena: not recomputed per unused prediction)
        slot_bytes = source.expert_bytes
        self.store = Store(arena.slots, self.live, make_policy(cfg.policy, layers),
                           key_bytes=lambda key: slot_bytes, index=self.index, reuse=Reuse(),
                           reserve=reserve_for(arena.slots))
        self.warm = WarmState(cfg, source, self.store, self.t0)     # restores the policy's statistics
        self.stats = self.store.stats
        self.latency = FetchLatency()
        # /metrics reads status through this board, never the store (k3d/observe/metrics.py)
        self.board = board or SnapshotBoard()
        self.board.wake = self._wake
        self.sessions = Sessions()
        self._stop = self._reload = False
        self.reloader = None     # () -> Config, set by the daemon; SIGHUP calls it
        self._ops = {name[3:]: getattr(self, name) for name in dir(self) if name.startswith("op_")}
        if sock is None:
            self.ctx = zmq.Context()
            self.sock = wire.open_endpoint(self.ctx, cfg.endpoint)
        else:
            self.ctx, self.sock = sock.context, sock
        if not ipc_path(cfg.endpoint):
            log.warning("endpoint %s is not ipc: peers have no credentials, so no uid check", cfg.endpoint)
        self.sock.setsockopt(zmq.RCVTIMEO, IDLE_MS)    # the blocking receive's limit (see "How it waits")
        self.waker = wire.Waker(self.ctx, self.sock, str(self.gen))
        self.arena_socket = arena_socket
        self.handout = ArenaHandout(arena_socket, arena, self.gen, self.index)
        with private_umask():
            self.handout.bind()
        self.handout.start()
        self.replies = wire.Replies(self.sock, self.gen)
        # requests in turn, each client's CPU charged, a client far over its share held back
        self.intake = Intake(self.sock, self.sessions, self.stats, self.live, self._handle)
        self.cache = FetchService(self.store, source, arena, cfg.readers, self.replies, self.latency,
                           self.intake.charge)
        self.reads = self.cache.reads       # the daemon asks it whether a reader is stuck
        self.cache.client_predictions = cfg.predict != "off"
        if cfg.predict == "auto":           # the daemon's own predictions (k3d/cache/predict/)
            self.cache.auto = AutoPrefetch(self.store, make_predictor(
                PREDICT_DEFAULT, 1 + max(l for l, _ in source.keys), 1 + max(e for _, e in source.keys)),
                cfg.predict_budget, known=frozenset(source.keys))
            self.warm.adopt(self.cache.auto.predictor)
        self.cache.preload(self.warm.preload(self.store))   # behind every urgent read

    # -- loop -----------------------------------------------------------------
    def request_stop(self) -> None:
        """Safe from a signal handler or another thread: the loop drains and exits."""
        self._stop = True
        self._wake()

    def request_reload(self) -> None:
        """Safe from a signal handler (SIGHUP): the loop re-reads the config."""
        self._reload = True
        self._wake()

    def _wake(self) -> None:
        """Make the loop's wait end now: a message on its socket ends a poll and a blocking receive alike."""
        self.waker.wake()

    def _do_reload(self) -> None:
        self._reload = False
        self.cfg = reload.run(self.cfg, self.reloader, self.live, self.t0, self.notifier, self.status_line)

    def serve_forever(self) -> None:
        next_reap = next_status = next_wd = time.monotonic()
        wd = self.notifier.watchdog_interval if self.notifier else None
        intake, cache, board, reads = self.intake, self.cache, self.board, self.reads
        monotonic = time.monotonic
        try:
            while not self._stop:
                intake.wait(reads)
                if self._reload:
                    self._do_reload()
                if board.wanted:
                    board.publish(self.status())
                cache.apply_done()
                cache.parked.flush()            # partial replies: one per streaming fetch per pass
                if intake.waiting:
                    self._serve_one(monotonic())
                now = monotonic()
                if now >= next_reap:
                    for s, reason in self.sessions.expired(now, self.live.lease_s):
                        self._drop(s, reason, dead=True)
                    patience = max([self.live.lease_s, *(s.lease_s for s in self.sessions)])
                    for c in self.store.reuse.lagging(now - patience):
                        if self.intake.turns.queued(self.sessions.by_id[c].routing):
                            continue                # its count may wait in its turn (over the cap, refused: resent)
                        self._drop(self.sessions.by_id[c], "reported no index count for a lease while slots "
                                   "it held back waited (k3d/cache/reuse.py)", dead=True)
                    self.cache.settle(now)          # slots no client can read any more (a dead one left)
                    next_reap = now + REAP_INTERVAL
                    self.warm.tick(self.store, now)
                if self.notifier is not None:
                    if now >= next_status:
                        self.notifier.status(self.status_line())
                        next_status = now + STATUS_INTERVAL
                    if wd and now >= next_wd:
                        self.notifier.watchdog()
                        next_wd = now + wd
        finally:
            self._shutdown()

    def _serve_one(self, now: float) -> None:
        """Handle the next request in turn (one per loop pass: finished reads and new
        requests are taken in between); its loop CPU is charged to its client."""
        item = self.intake.next(now)
        if item is None:                       # only held clients' requests wait
            return
        t0, routing, frames = item
        pacing = self.intake.pacing
        cpu = time.thread_time() if pacing else 0.0
        s = self._handle(routing, self.sessions.get(routing), frames, t0)
        self.cache.settle(time.monotonic())
        if pacing and s is not None:
            self.intake.charge_session(s, time.thread_time() - cpu)

    def _refuse(self, s, routing, msg, frame, t0):
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

    # -- dispatch: the one place that turns exceptions into error replies ---
    def _handle(self, routing: bytes, s: Session | None, frames, t0: float,
                over_cap: bool = False) -> Session | None:
        """Handle one request from ``routing`` (session ``s``, None before hello) that
        arrived at ``t0``; returns the session it ran for.  ``over_cap``: it came with its
        client's cap of waiting requests full (``_refuse``)."""
        rid = None
        reader = None                          # a hit-path client waiting for this reply
        try:
            msg, rid = wire.decode(frames)
            wire.check_version(msg)
            op = msg.get("op")
            handler = self._ops.get(op) if isinstance(op, str) else None
            if handler is None:
                raise BadRequest(f"unknown op {op!r}; known ops: {', '.join(sorted(self._ops))}")
            if over_cap and op != "heartbeat":
                handler = self._refuse
            if s is not None:
                s.last_seen = t0
                if s.hit_path and op not in ASYNC_OPS and not over_cap:
                    reader = s.client_id
                    self.store.reuse.waiting(reader, rid)
            result = handler(s, routing, msg, frames[0], t0)
        except K3Error as e:
            if isinstance(e, (BadRequest, ProtocolMismatch, UnknownExpert, NotAttached)):
                self.stats.bad_requests += 1
            self.replies.error(routing, rid, e)
        except Exception as e:  # a bug in a handler must not take the daemon down
            log.exception("internal error handling a request")
            self.replies.error(routing, rid, K3Error(f"internal error in k3d: {type(e).__name__}: {e}"))
        else:
            if result is DEFERRED or result is NO_REPLY:
                return s if s is not None else self.sessions.get(routing)
            self.replies.ok(routing, rid, result)
            if reader is not None:
                self.store.reuse.replied(reader, rid, ok=True)
            return s if s is not None else self.sessions.get(routing)
        if reader is not None:               # a failure keeps its window shut (k3d/cache/reuse.py, C1)
            self.store.reuse.replied(reader, rid, ok=False)
        return s if s is not None else self.sessions.get(routing)

    def _keys(self, msg: dict, field: str, unique: bool) -> list[tuple[int, int]]:
        return wire.keys(msg, field, unique, self.source)

    def _hits(self, msg: dict):
        return wire.hits(msg, self.source, self.arena.slots)

    def _reports(self, s: Session, msg: dict, now: float) -> None:
        """The message's hit reports, then its ``done`` layers (protocol 6): a report may
        name a layer the same message releases (the client read it before it was done)."""
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

    # -- clients ----------------------------------------------------------------
    def _drop(self, s: Session, reason: str, dead: bool) -> None:
        self.sessions.remove(s)
        self.intake.left(s, dead)
        released = self.cache.drop(s, reason)
        if dead:
            self.stats.clients_dead += 1
            log.warning("client %s (pid %s) %s: released %d pins", s.name, s.pid, reason, released)
        else:
            log.info("client %s (pid %s) %s: released %d pins", s.name, s.pid, reason, released)

    # -- status -------------------------------------------------------------------
    def status(self) -> dict:
        return status_view.build(self, time.monotonic())

    def status_line(self) -> str:
        return status_view.line(self)

    # -- shutdown -----------------------------------------------------------------
    def _shutdown(self) -> None:
        self.warm.save(self.store)
        self.board.close()            # a scrape waiting on the loop gets the last snapshot now
        if self.notifier is not None:
            self.notifier.stopping()
        log.info("draining: stop accepting, cancel queued reads")
        self.handout.close()
        self.cache.shut_down()        # cancelled reads answer ShuttingDown, not ReadFailed
        self.index.close()
        self.waker.close()            # (before the context ends: it waits for every socket)
        self.sock.close()
        self.ctx.term()
        path = ipc_path(self.cfg.endpoint)
        if path:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        if self.live.trace:
            self.live.trace.close()
