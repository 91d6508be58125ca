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

Requests: ``_handle`` decodes one, looks its op up in ``ops`` (``ops.py``: one
small handler per op, its docstring the spec) and is the one place that turns
exceptions into error replies; nothing a client sends can stop the loop.  The
client's session is looked up once per request.  For a hit-path client it tells
``reuse`` that the request waits and then whether it was answered: that reply is
one of the client's quiescent points for the deferred reuse of evicted slots
(``cache/reuse.py``; ``ops.py`` names the others).

Who does what (all on this thread; reader threads only fill slot memory):
- ``wire``: the ROUTER socket, request decoding, key and report checks, replies;
- ``ops``: the handlers, each one call into the fetch service;
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
from k3d.cache.sessions import REAP_INTERVAL, Session, Sessions
from k3d.cache.store import Store
from k3d.cache.warm import WarmState
from k3d.config import Live
from k3d.memory.index import SharedIndex
from k3d.observe import status as status_view
from k3d.observe.latency import FetchLatency
from k3d.observe.metrics import SnapshotBoard
from k3d.observe.trace import RouteTrace
from k3d.serve import reload, wire
from k3d.serve.access import private_umask
from k3d.serve.handout import ArenaHandout
from k3d.serve.intake import IDLE_MS, Intake
from k3d.serve.ops import ASYNC_OPS, DEFERRED, NO_REPLY, Ops

log = logging.getLogger("k3d")

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
        self.ops = Ops(gen=self.gen, source=source, arena=arena, arena_socket=arena_socket, index=self.index,
                       live=self.live, store=self.store, cache=self.cache, sessions=self.sessions,
                       stats=self.stats, drop=self._drop, status=self.status)

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

    # -- dispatch: the one place that turns exceptions into error replies ---
    def _handle(self, routing: bytes, s: Session | None, frames, t0: float,
                over_cap: bool = False) -> Session | None:
        """Handle one request from ``routing`` (session ``s``, None before hello) that
        arrived at ``t0``; returns the session it ran for.  ``over_cap``: it came with its
        client's cap of waiting requests full (``Ops.refuse``)."""
        rid = None
        reader = None                          # a hit-path client waiting for this reply
        try:
            msg, rid = wire.decode(frames)
            wire.check_version(msg)
            op = msg.get("op")
            ops = self.ops.by_name
            handler = ops.get(op) if isinstance(op, str) else None
            if handler is None:
                raise BadRequest(f"unknown op {op!r}; known ops: {', '.join(sorted(ops))}")
            if over_cap and op != "heartbeat":
                handler = self.ops.refuse
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
