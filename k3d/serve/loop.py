"""The server loop: one thread owns the ROUTER socket, the store and the policy.

Loop (``serve_forever``): poll the ROUTER socket, the reader pool's eventfd and
the arena hand-out socket; handle every ready request, apply every finished
read, hand out the arena fd, publish a status snapshot when ``/metrics`` asked
for one (``metrics.SnapshotBoard``: other threads never read the store), then
housekeeping (dead clients, systemd status and watchdog).  The ROUTER socket
usually arrives bound: the daemon binds it before start-up and the start-up
responder (``service/starting.py``) hands it over.  Nothing in the loop waits on I/O: a fetch that misses starts
reads and is parked (``parked.py``) until its slots are ready, while other
clients' hits are answered at once.

One small handler per op (``op_*``); its docstring is the spec.  ``_handle`` is
the one place that turns exceptions into error replies; nothing a client sends
can stop the loop.

Every reply that names slots is checked against the store first
(``parked.checked_slots``: each slot READY and holding the requested key): a
reply never names a loading or reused slot, whatever a client does.

Who does what (all on this thread; reader threads only fill slot memory and
report through ``reads``):
- ``wire``: the ROUTER socket, request decoding, key checks, replies;
- ``intake``: requests off the socket into ``turns`` (waiting for their
  client's turn) and each client's CPU charged to ``pacing``;
- ``sessions``: attached clients and their liveness;
- ``cache``: the fetch path, keeping three in step: ``store`` (slots, pins,
  predictions; changed only through its methods), ``reads.loads`` (reads in
  flight, by explicit load token: start, promote, cancel, finish) and
  ``parked`` (fetches waiting for their reads, and how each is answered);
- ``handout``: the arena fd over the Unix socket;
- ``status``, ``reload``: what status shows; what SIGHUP may change;
- ``latency``, ``trace``: fetch latency histogram; the optional route trace.

Signals: the CLI's handlers only call ``request_stop`` / ``request_reload``
(set a flag and write the eventfd); the loop acts.  Stop drains: stop
accepting, cancel queued reads, wait for running ones, answer parked fetches
with an error, release the arena.

Fair share of the loop: requests are taken off the socket into ``turns``
(one queue per client, ``intake.py``) and served one per loop pass by deficit round-robin
(``turns.py``: clients with requests waiting take turns, each with a budget
per turn, a request costing by its size), so a client flooding big requests
cannot make the others wait behind all of them.  Fair share of the readers: a
client's urgent reads go through its fair share (``reads/fair.py``), so one
client's huge cold fetch cannot put every other client's miss behind all of it.
Fair share of the CPU (``intake.py``): every request's loop time and every
read's reader time is charged to its client (thread CPU time); a client using far more than the
others while they are active is held back before its next request
(``pacing.py``), so a client sending as fast as it is answered sleeps instead.

Access (``access.py``): both sockets are created mode 0660 in a 0750 directory, and every
peer is checked again from its kernel credentials (ZeroMQ ``Peer-Address`` on
hello, SO_PEERCRED on the arena socket): the daemon's uid, root, or a member
of the daemon's gid; anyone else gets PermissionDenied and a log line.
"""

from __future__ import annotations

import logging
import os
import random
import time

import zmq

from k3client import errors
from k3client.endpoint import ipc_path
from k3client.errors import (
    BadRequest,
    K3Error,
    NotAttached,
    ProtocolMismatch,
    UnknownExpert,
)
from k3d.cache.fetch import Cache
from k3d.cache.policy import make as make_policy
from k3d.cache.sessions import REAP_INTERVAL, Session, Sessions, identify
from k3d.cache.store import Store
from k3d.cache.warm import WarmState
from k3d.observe import status as status_view
from k3d.observe.latency import FetchLatency
from k3d.observe.metrics import SnapshotBoard
from k3d.observe.trace import RouteTrace
from k3d.serve import reload, wire
from k3d.serve.access import peer_allowed, peer_cred, private_umask, refusal
from k3d.serve.handout import ArenaHandout
from k3d.serve.intake import Intake

log = logging.getLogger("k3d")

DEFERRED = object()      # handler parked the request; it replies later
NO_REPLY = object()      # heartbeat: nothing to send
STATUS_INTERVAL = 5.0    # seconds between systemd STATUS= lines


class Server:
    def __init__(self, cfg, source, arena, arena_socket: str, notifier=None, board=None, sock=None):
        """``sock``: the endpoint's ROUTER socket, already bound (the daemon binds it before
        the arena is built, so that it answers status while starting); None: bind it here."""
        self.cfg, self.source, self.arena = cfg, source, arena
        self.notifier = notifier
        self.t0 = time.monotonic()
        self.gen = random.getrandbits(62) | 1
        self.store = Store(arena.slots, cfg.pin_quota, make_policy(cfg.policy, 1 + max(l for l, _ in source.keys)),
                           key_bytes=lambda key: source.expert_bytes)
        self.warm = WarmState(cfg, source, self.store, self.t0)     # restores the policy's statistics
        self.stats = self.store.stats
        self.latency = FetchLatency()
        self._t_msg = 0.0        # arrival of the request being handled (fetch latency)
        # /metrics reads status through this board, never the store (k3d/observe/metrics.py)
        self.board = board or SnapshotBoard()
        self.board.wake = self._wake
        self.trace = RouteTrace(cfg.trace, self.t0) if cfg.trace else None
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
        self.arena_socket = arena_socket
        self.handout = ArenaHandout(arena_socket, arena, self.gen)
        with private_umask():
            self.handout.bind()
        self.replies = wire.Replies(self.sock, self.gen)
        # requests in turn, each client's CPU charged, a client far over its share held back
        self.intake = Intake(self.sock, self.sessions, self.stats, cfg.max_share)
        self.cache = Cache(self.store, source, arena, cfg.readers, self.replies, self.latency,
                           self.intake.charge)
        self.reads = self.cache.reads       # the daemon asks it whether a reader is stuck
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
        """Make the loop's poll return now (it polls the reader pool's eventfd)."""
        try:
            os.eventfd_write(self.reads.wake_fd, 1)
        except (OSError, TypeError, AttributeError):   # the pool already stopped (or not yet made)
            pass

    def _do_reload(self) -> None:
        self._reload = False
        if self.notifier is not None:
            self.notifier.send("RELOADING=1", f"MONOTONIC_USEC={time.monotonic_ns() // 1000}")
        try:
            new = self.reloader() if self.reloader else self.cfg
        except Exception as e:  # noqa: BLE001 -- a bad file must not take a serving daemon down
            log.error("reload failed, keeping the running config: %s", e)
        else:
            self.apply_config(new)
        if self.notifier is not None:
            self.notifier.send("READY=1", f"STATUS={self.status_line()}")

    def apply_config(self, new) -> None:
        """Apply the ``reload.LIVE`` settings of ``new``; log the rest as needing a restart."""
        self.cfg, self.trace = reload.apply(self.cfg, new, self.trace, self.t0)
        self.store.pin_quota = self.cfg.pin_quota
        self.intake.pacer.share = self.cfg.max_share

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.reads.wake_fd, zmq.POLLIN)
        poller.register(self.handout.fileno(), zmq.POLLIN)
        next_reap = next_status = next_wd = time.monotonic()
        wd = self.notifier.watchdog_interval if self.notifier else None
        try:
            while not self._stop:
                try:
                    events = dict(poller.poll(self.intake.poll_ms()))
                except zmq.ZMQError as e:
                    if e.errno == zmq.EINTR:
                        continue
                    raise
                if self.reads.wake_fd in events:
                    self.reads.drain_wake()
                if self._reload:
                    self._do_reload()
                if self.board.wanted:
                    self.board.publish(self.status())
                self.cache.apply_done()
                if self.sock in events:
                    self.intake.receive()
                if self.intake.waiting:
                    self._serve_one(time.monotonic())
                if self.handout.fileno() in events:
                    self.handout.serve()
                now = time.monotonic()
                if now >= next_reap:
                    for s, reason in self.sessions.expired(now, self.cfg.lease_s):
                        self._drop(s, reason, dead=True)
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
        self._t_msg, frames = item
        routing = frames[0].bytes
        cpu = time.thread_time()
        self._handle(routing, frames[1:])
        s = self.sessions.get(routing)
        if s is not None:
            self.intake.charge(s.client_id, time.thread_time() - cpu)

    # -- dispatch: the one place that turns exceptions into error replies ---
    def _handle(self, routing: bytes, frames) -> None:
        rid = None
        try:
            msg, rid = wire.decode(frames)
            wire.check_version(msg)
            op = msg.get("op")
            handler = self._ops.get(op) if isinstance(op, str) else None
            if handler is None:
                raise BadRequest(f"unknown op {op!r}; known ops: {', '.join(sorted(self._ops))}")
            result = handler(routing, msg, frames[0])
        except K3Error as e:
            if isinstance(e, (BadRequest, ProtocolMismatch, UnknownExpert, NotAttached)):
                self.stats.bad_requests += 1
            self.replies.error(routing, rid, e)
            return
        except Exception as e:  # a bug in a handler must not take the daemon down
            log.exception("internal error handling a request")
            self.replies.error(routing, rid, K3Error(f"internal error in k3d: {type(e).__name__}: {e}"))
            return
        if result is DEFERRED or result is NO_REPLY:
            return
        self.replies.ok(routing, rid, result)

    def _keys(self, msg: dict, field: str, unique: bool) -> list[tuple[int, int]]:
        return wire.keys(msg, field, unique, self.source)

    # -- ops -----------------------------------------------------------------
    def op_hello(self, routing, msg, frame):
        """hello {name: str, pid: int} -> {client_id, layout, arena_socket, ...}.

        First message of every client.  Identifies the process (the ipc peer pid
        wins over the one the client claims) for liveness checks, starts epoch 0,
        and returns the layout and where to get the arena fd."""
        name = msg.get("name")
        if not isinstance(name, str) or not name:
            raise BadRequest("hello: name must be a non-empty string")
        uid, gid, pid = peer_cred(frame)
        if not peer_allowed(uid, gid, pid):
            log.warning("refused client %r: uid %s gid %s pid %s is not allowed", name[:200], uid, gid, pid)
            raise errors.PermissionDenied(refusal(uid, gid, pid))
        if pid is None and type(msg.get("pid")) is int:
            pid = msg["pid"]
        pid, started = identify(pid)
        old = self.sessions.get(routing)
        if old is not None:
            self._drop(old, "said hello again", dead=False)
        s = self.sessions.attach(routing, name[:200], pid, started, time.monotonic(), self.cfg.lease_s)
        log.info("client %s (pid %s) attached as #%d", s.name, pid, s.client_id)
        return {"client_id": s.client_id, "layout": [t.to_wire() for t in self.source.layout],
                "slots": self.arena.slots, "slot_bytes": self.arena.slot_bytes,
                "expert_bytes": self.source.expert_bytes, "arena_bytes": self.arena.size,
                "arena_socket": self.arena_socket, "lease_s": self.cfg.lease_s,
                "model": self.source.describe()}

    def op_fetch(self, routing, msg, frame):
        """fetch {keys: [[layer, expert], ...], predicted?: [[l, e], ...]} -> {slots: [...]}.

        Hits are touched and pinned under (client, epoch); keys being read are
        waited on (hit + waited); misses take free or LRU-evicted slots and are
        read URGENT, split into parts across readers.  Replies once every key is
        ready, slots in request order.  ``predicted`` is handled as ``predict``
        after the fetch is planned.  Errors: cache full (nothing changes),
        quota, unknown or duplicate keys, a failed read."""
        s = self.sessions.require(routing, time.monotonic())
        keys = self._keys(msg, "keys", unique=True)
        if not keys:
            raise BadRequest("fetch of zero keys")
        predicted = self._keys(msg, "predicted", unique=False) if msg.get("predicted") is not None else []
        plan = self.cache.plan(s, keys)
        if self.trace:
            try:
                self.trace.fetch(time.monotonic(), s.client_id, s.epoch, keys, plan.misses,
                                 plan.evictions, plan.waited, plan.prefetched_hits, s.pfu)
            except OSError as e:   # a full disk must not fail a fetch that is already planned
                log.error("route trace %s: %s; tracing stops", self.trace.path, e)
                self.trace = None
        s.pfu = 0
        if predicted:
            self.cache.predict(s, predicted, self.cfg.pin_quota, self.trace)
        slots = self.cache.answer(s, msg["id"], keys, plan, self._t_msg)
        return DEFERRED if slots is None else {"slots": slots}

    def op_predict(self, routing, msg, frame):
        """predict {keys: [[layer, expert], ...]} -> {queued: int}, at once.

        Keys not resident get slots while one is free or evictable (stopping at
        the first that is not) and are read BACKGROUND, behind every urgent
        read.  Unfetched by the predictor's next begin_token, they count
        prefetch_unused and are demoted to the LRU end.  With a pin quota, a
        client has at most that many predictions outstanding (the rest are
        dropped), and a client whose predictions go almost all unused (moving
        share > ``cache.WASTE_LIMIT``) may start one read per token: a flood of
        predictions can neither sweep the cache nor monopolise the readers."""
        s = self.sessions.require(routing, time.monotonic())
        return {"queued": self.cache.predict(s, self._keys(msg, "keys", unique=False), self.cfg.pin_quota,
                                             self.trace)}

    def op_begin_token(self, routing, msg, frame):
        """begin_token {} -> {epoch, released}: next epoch; the previous epoch's pins go."""
        s = self.sessions.require(routing, time.monotonic())
        if self.trace:
            self.trace.begin(time.monotonic(), s.client_id, s.epoch)
        released = self.cache.end_token(s)
        return {"epoch": s.epoch, "released": released}

    def op_heartbeat(self, routing, msg, frame):
        """heartbeat {client_id, gen?} -> no reply; renews the client's lease.

        A heartbeat for another generation (queued while this daemon was
        restarting) is ignored: its client_id names someone else here."""
        if msg.get("gen", self.gen) == self.gen:
            self.sessions.heartbeat(msg.get("client_id"), time.monotonic())
        return NO_REPLY

    def op_status(self, routing, msg, frame):
        """status {} -> {status: {...}}; needs no hello (k3ctl uses it)."""
        return {"status": self.status()}

    def op_bye(self, routing, msg, frame):
        """bye {} -> {}: the client leaves; its pins and predictions are released."""
        s = self.sessions.get(routing)
        if s is not None:
            self._drop(s, "said bye", dead=False)
        return {}

    # -- clients ----------------------------------------------------------------
    def _drop(self, s: Session, reason: str, dead: bool) -> None:
        self.sessions.remove(s)
        self.intake.left(s, dead)
        if self.trace:
            self.trace.bye(time.monotonic(), s.client_id)
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
        self.sock.close()
        self.ctx.term()
        path = ipc_path(self.cfg.endpoint)
        if path:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        if self.trace:
            self.trace.close()
