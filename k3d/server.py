"""The server loop: one thread owns the ROUTER socket, the store and the policy.

Loop (``serve_forever``): poll the ROUTER socket, the reader pool's eventfd and
the arena-handout Unix socket; handle every ready request, apply every finished
read, hand out the arena fd, then housekeeping (dead clients, systemd status
and watchdog).  Nothing in the loop waits on I/O: a fetch that misses starts
reads and is parked (``Pending``) until its slots are ready, while other
clients' hits are answered at once.

One small handler per op (``op_*``); its docstring is the spec.  ``_handle`` is
the one place that turns exceptions into error replies; nothing a client sends
can stop the loop.

Every reply that names slots is checked against the store first (each slot
READY and holding the requested key): a reply never names a loading or reused
slot, whatever a client does.

Signals: the CLI's handlers only call ``request_stop`` / ``request_reload``
(set a flag and write the eventfd); the loop acts.  Stop drains: stop
accepting, cancel queued reads, wait for running ones, answer parked fetches
with an error, release the arena.  Reload (SIGHUP) re-resolves the config and
applies the settings that can change live (``LIVE``); the others are kept
until a restart, with a log line saying so.

Fair share of the readers: a client's urgent reads go through ``FairReads``
(``k3d/fair_reads.py``), so one client's huge cold fetch cannot put every other
client's miss behind all of it.

Access (``k3d/access.py``): both sockets are created mode 0660 in a 0750 directory, and every
peer is checked again from its kernel credentials (ZeroMQ ``Peer-Address`` on
hello, SO_PEERCRED on the arena socket): the daemon's uid, root, or a member
of the daemon's gid; anyone else gets PermissionDenied and a log line.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import random
import socket
import time

import zmq

from k3client import errors
from k3client.endpoint import ipc_path
from k3client.errors import BadRequest, K3Error, NotAttached, ProtocolMismatch, UnknownExpert
from k3client.protocol import MAX_KEYS, MAX_MESSAGE_BYTES, PROTOCOL_VERSION, pack, unpack

from . import __version__
from .access import peer_allowed, peer_cred, refusal, unix_peer_cred
from .latency import FetchLatency, classify
from .metrics import SnapshotBoard
from .reads.fair import FairReads
from .service.starting import open_endpoint
from .reads.pool import Job, ReaderPool
from .reads.plan import parts_per_key, split_extents
from .stats import Throughput
from .store import READY, Store
from .trace import RouteTrace

log = logging.getLogger("k3d")

DEFERRED = object()      # handler parked the request; it replies later
NO_REPLY = object()      # heartbeat: nothing to send
REAP_INTERVAL = 0.5
LIVE = ("log_level", "lease_s", "pin_quota", "trace")   # what SIGHUP may change
WASTE_LIMIT = 0.9        # share of unused predictions above which a client is throttled


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (/proc/PID/stat field 22);
    None if it is gone or a zombie (exited, not yet reaped).  Read by hand because
    psutil's ``create_time()`` is wall-clock time (boot time + ticks): a clock step (NTP,
    settimeofday) would move it, and every live client would then look like a reused pid
    and lose its pins.

    Any other OSError (EMFILE while fds run out) is raised: it says nothing about the
    process, and reading it as "gone" would drop a live client's pins."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    try:
        fields = stat[stat.rindex(b")") + 2:].split()     # fields from 3 (state) on, after "(comm) "
        return None if fields[0] == b"Z" else int(fields[19])
    except (ValueError, IndexError):
        return None


class Session:
    __slots__ = ("routing", "client_id", "name", "pid", "started", "epoch", "last_seen",
                 "pfu", "alive", "fetches", "lease_s", "pf_started", "pf_waste")

    def __init__(self, routing, client_id, name, pid, started, now, lease_s=0.0):
        self.routing, self.client_id, self.name = routing, client_id, name
        self.pid, self.started = pid, started
        self.epoch, self.last_seen, self.pfu, self.alive, self.fetches = 0, now, 0, True, 0
        # The lease told to the client at hello: it heartbeats at a quarter of it,
        # so a reload that shortens the lease applies to new clients only.
        self.lease_s = lease_s
        # Background reads this client started this epoch, and the moving share
        # of its predictions nobody fetched (the quota's prediction throttle).
        self.pf_started, self.pf_waste = 0, 0.0

    @property
    def holder(self):
        return (self.client_id, self.epoch)


class Pending:
    """A parked fetch; ``holder`` is the (client, epoch) its slots were pinned under."""

    __slots__ = ("session", "holder", "rid", "keys", "slots", "left", "done", "t0", "result")

    def __init__(self, session, rid, keys, slots, left, t0=0.0, result="miss"):
        self.session, self.rid, self.keys, self.slots, self.left = session, rid, keys, slots, left
        self.holder = session.holder
        self.done = False
        self.t0, self.result = t0, result     # arrival time and latency class (k3d/latency.py)


class Server:
    def __init__(self, cfg, source, arena, arena_socket: str, notifier=None, board=None, sock=None):
        """``sock``: the endpoint's ROUTER socket, already bound (the daemon binds it before
        the arena is built, so that it answers status while starting); None: bind it here."""
        self.cfg, self.source, self.arena = cfg, source, arena
        self.notifier = notifier
        self.t0 = time.monotonic()
        self.gen = random.getrandbits(62) | 1
        self.store = Store(arena.slots, cfg.pin_quota)
        self.stats = self.store.stats
        self.recent = Throughput()
        self.latency = FetchLatency()
        self._t_msg = 0.0        # arrival of the request being handled (fetch latency)
        # /metrics reads status through this board, never the store (k3d/metrics.py)
        self.board = board or SnapshotBoard()
        self.board.wake = self._wake
        self.trace = RouteTrace(cfg.trace, self.t0) if cfg.trace else None
        self.sessions: dict[bytes, Session] = {}
        self.by_id: dict[int, Session] = {}
        self.waiters: dict[int, list[Pending]] = {}
        self._next_client = 1
        self._stop = False
        self._draining = False
        self._reload = False
        self.reloader = None     # () -> Config, set by the daemon; SIGHUP calls it
        self._ops = {name[3:]: getattr(self, name) for name in dir(self) if name.startswith("op_")}
        if sock is None:
            self.ctx = zmq.Context()
            self.sock = open_endpoint(self.ctx, cfg.endpoint)
        else:
            self.ctx, self.sock = sock.context, sock
        self.arena_socket = arena_socket
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        # Sockets are born 0660 (umask during bind; chmod again in case the
        # umask was ignored): only the daemon's user and group may connect.
        old_umask = os.umask(0o117)
        try:
            self.listener.bind(arena_socket)
        finally:
            os.umask(old_umask)
        os.chmod(arena_socket, 0o660)
        if not ipc_path(cfg.endpoint):
            log.warning("endpoint %s is not ipc: peers have no credentials, so no uid check", cfg.endpoint)
        self.listener.listen(64)
        self.listener.setblocking(False)
        self.readers = ReaderPool(cfg.readers)
        # Two parts per reader keep the pool busy for a lone client (no idle
        # reader between a part's end and the next submit).
        self.fair = FairReads(self.readers, fair_jobs=2 * self.readers.threads)

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
            os.eventfd_write(self.readers.wake_fd, 1)
        except (OSError, TypeError, AttributeError):   # the pool already stopped (or not yet made)
            pass

    def _do_reload(self) -> None:
        self._reload = False
        if self.notifier is not None:
            self.notifier.send("RELOADING=1", f"MONOTONIC_USEC={time.monotonic_ns() // 1000}")
        try:
            new = self.reloader() if self.reloader else self.cfg
        except Exception as e:   # a bad file must not take a serving daemon down
            log.error("reload failed, keeping the running config: %s", e)
        else:
            self.apply_config(new)
        if self.notifier is not None:
            self.notifier.send("READY=1", f"STATUS={self.status_line()}")

    def apply_config(self, new) -> None:
        """Apply the ``LIVE`` settings of ``new``; log the rest as needing a restart."""
        cur = self.cfg
        fixed = [f.name for f in dataclasses.fields(cur)
                 if f.name not in LIVE and getattr(cur, f.name) != getattr(new, f.name)]
        trace = self.trace
        if new.trace:
            try:   # always reopen: after logrotate moved the file, a new one starts
                trace = RouteTrace(new.trace, self.t0)
            except OSError as e:
                log.error("reload: cannot open trace %s (%s); keeping the old one", new.trace, e)
                new = dataclasses.replace(new, trace=cur.trace)
        else:
            trace = None
        if self.trace is not None and trace is not self.trace:
            self.trace.close()
        self.trace = trace
        changed = [f"{n} {getattr(cur, n)!r} -> {getattr(new, n)!r}" for n in LIVE   # as applied
                   if getattr(cur, n) != getattr(new, n)]
        logging.getLogger().setLevel(new.log_level.upper())
        self.store.pin_quota = new.pin_quota
        self.cfg = dataclasses.replace(cur, **{n: getattr(new, n) for n in LIVE})
        if fixed:
            log.warning("reload: %s only change on restart; keeping the running values", ", ".join(fixed))
        log.info("reloaded config: %s", ", ".join(changed) or "no live setting changed")

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.readers.wake_fd, zmq.POLLIN)
        poller.register(self.listener.fileno(), zmq.POLLIN)
        next_reap = next_status = time.monotonic()
        wd = self.notifier.watchdog_interval if self.notifier else None
        next_wd = time.monotonic()
        try:
            while not self._stop:
                try:
                    events = dict(poller.poll(100))
                except zmq.ZMQError as e:
                    if e.errno == zmq.EINTR:
                        continue
                    raise
                if self.readers.wake_fd in events:
                    self.readers.drain_wake()
                if self._reload:
                    self._do_reload()
                if self.board.wanted:
                    self.board.publish(self.status())
                self._apply_done()
                if self.sock in events:
                    self._recv_one()
                if self.listener.fileno() in events:
                    self._hand_out_arena()
                now = time.monotonic()
                if now >= next_reap:
                    self._reap(now)
                    next_reap = now + REAP_INTERVAL
                if self.notifier is not None:
                    if now >= next_status:
                        self.notifier.status(self.status_line())
                        next_status = now + 5.0
                    if wd and now >= next_wd:
                        self.notifier.watchdog()
                        next_wd = now + wd
        finally:
            self._shutdown()

    def _recv_one(self) -> None:
        # One message per wake-up: the poll is level-triggered and reports the
        # socket again while messages wait, so looping until zmq.Again would only
        # add a failing recv (several µs here) to every request.
        try:
            frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        self._t_msg = time.monotonic()
        self._handle(frames[0].bytes, frames[1:])

    # -- dispatch: the one place that turns exceptions into error replies ---
    def _handle(self, routing: bytes, frames) -> None:
        rid = None
        try:
            if len(frames) != 1:
                raise BadRequest(f"expected one msgpack frame, got {len(frames)}")
            raw = frames[0].bytes
            if len(raw) > MAX_MESSAGE_BYTES:
                raise BadRequest(f"message of {len(raw)} bytes exceeds the {MAX_MESSAGE_BYTES} byte limit")
            try:
                msg = unpack(raw)
            except Exception as e:
                raise BadRequest(f"message is not msgpack within the decode limits ({type(e).__name__}: {e})") from None
            if not isinstance(msg, dict):
                raise BadRequest("message must be a msgpack map with v, op and id")
            rid = msg.get("id")
            if type(rid) is not int:
                rid = None
                raise BadRequest("field 'id' must be an integer")
            if msg.get("v") != PROTOCOL_VERSION:
                raise ProtocolMismatch(
                    f"client speaks protocol {msg.get('v')!r}, this daemon speaks {PROTOCOL_VERSION}; "
                    "install matching k3client and k3d versions")
            op = msg.get("op")
            handler = self._ops.get(op) if isinstance(op, str) else None
            if handler is None:
                raise BadRequest(f"unknown op {op!r}; known ops: {', '.join(sorted(self._ops))}")
            result = handler(routing, msg, frames[0])
        except K3Error as e:
            if isinstance(e, (BadRequest, ProtocolMismatch, UnknownExpert, NotAttached)):
                self.stats.bad_requests += 1
            self._send_error(routing, rid, e)
            return
        except Exception as e:  # a bug in a handler must not take the daemon down
            log.exception("internal error handling a request")
            self._send_error(routing, rid, K3Error(f"internal error in k3d: {type(e).__name__}: {e}"))
            return
        if result is DEFERRED or result is NO_REPLY:
            return
        self._send(routing, rid, result)

    def _send(self, routing: bytes, rid, fields: dict) -> None:
        reply = {"id": rid, "ok": True, "gen": self.gen}
        reply.update(fields)
        self._send_raw(routing, reply)

    def _send_error(self, routing: bytes, rid, e: K3Error) -> None:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if len(msg) > 1024:   # messages may quote client input: keep replies within the decode limits
            msg = msg[:1021] + "..."
        self._send_raw(routing, {"id": rid, "ok": False, "gen": self.gen,
                                 "error": {"code": e.code, "message": msg}})

    def _send_raw(self, routing: bytes, reply: dict) -> None:
        try:
            self.sock.send_multipart([routing, pack(reply)], zmq.NOBLOCK)
        except zmq.ZMQError as e:   # peer gone (ROUTER_MANDATORY) or flooding
            log.debug("dropping reply to a gone peer: %s", e)

    # -- validation ----------------------------------------------------------
    def _session(self, routing: bytes) -> Session:
        s = self.sessions.get(routing)
        if s is None:
            raise NotAttached("send hello first (k3client.connect does this); or the daemon dropped this client")
        s.last_seen = time.monotonic()
        return s

    def _keys(self, msg: dict, field: str, unique: bool) -> list[tuple[int, int]]:
        raw = msg.get(field)
        if not isinstance(raw, list):
            raise BadRequest(f"{field} must be a list of [layer, expert] pairs")
        if len(raw) > MAX_KEYS:
            raise BadRequest(f"{field} has {len(raw)} keys; at most {MAX_KEYS} per request")
        # Fast path for well-formed requests (the hit path); the loop below
        # re-checks key by key only to name the first bad one.
        try:
            out = [(l, e) for l, e in raw]
        except (TypeError, ValueError):
            out = None
        if (out is not None and all(type(l) is int and type(e) is int for l, e in out)
                and self.source.keys.keys() >= set(out) and (not unique or len(set(out)) == len(out))):
            return out
        out = []
        for item in raw:
            if not (isinstance(item, list) and len(item) == 2 and all(type(x) is int for x in item)):
                raise BadRequest(f"{field}: {item!r} is not a [layer, expert] pair of integers")
            key = (item[0], item[1])
            if key not in self.source.keys:
                raise UnknownExpert(self.source.unknown(key))
            out.append(key)
        if unique and len(set(out)) != len(out):
            seen = set()
            dup = next(k for k in out if k in seen or seen.add(k))
            raise BadRequest(f"{field}: duplicate key (layer {dup[0]}, expert {dup[1]})")
        return out

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
        started = None
        if pid is not None:
            try:
                started = start_ticks(pid)
            except OSError:
                started = None
            if started is None:
                pid = None
        old = self.sessions.get(routing)
        if old is not None:
            self._drop(old, "said hello again", dead=False)
        now = time.monotonic()
        s = Session(routing, self._next_client, name[:200], pid, started, now, self.cfg.lease_s)
        self._next_client += 1
        self.sessions[routing] = s
        self.by_id[s.client_id] = s
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
        s = self._session(routing)
        keys = self._keys(msg, "keys", unique=True)
        if not keys:
            raise BadRequest("fetch of zero keys")
        predicted = self._keys(msg, "predicted", unique=False) if msg.get("predicted") is not None else []
        plan = self.store.fetch(s.holder, keys)
        self._start_loads(plan.new_loads, urgent=True, owner=s.client_id)
        for slot in plan.promote:     # its predicted reads not started yet: urgent, in its fair share
            taken = self.readers.take_background(slot)
            if taken:
                self.fair.submit(taken, s.client_id)
        for slot in plan.waiting:     # someone else's held-back read: this client waits too
            self.fair.waited_on(slot, s.client_id)
        s.fetches += 1
        if self.trace:
            try:
                self.trace.fetch(time.monotonic(), keys[0][0], [e for _, e in keys], plan.misses,
                                 plan.evictions, plan.waited, plan.prefetched_hits, s.pfu)
            except OSError as e:   # a full disk must not fail a fetch that is already planned
                log.error("route trace %s: %s; tracing stops", self.trace.path, e)
                self.trace = None
        s.pfu = 0
        if predicted:
            self._predict(s, predicted)
        result = classify(plan.misses, plan.waited)
        if not plan.waiting:
            slots = self._checked_slots(keys, plan.slots)
            self.latency.record(result, time.monotonic() - self._t_msg)
            return {"slots": slots}
        p = Pending(s, msg["id"], keys, plan.slots, set(plan.waiting), self._t_msg, result)
        for slot in plan.waiting:
            self.waiters.setdefault(slot, []).append(p)
        return DEFERRED

    def op_predict(self, routing, msg, frame):
        """predict {keys: [[layer, expert], ...]} -> {queued: int}, at once.

        Keys not resident get slots while one is free or evictable (stopping at
        the first that is not) and are read BACKGROUND, behind every urgent
        read.  Unfetched by the predictor's next begin_token, they count
        prefetch_unused and are demoted to the LRU end.  With a pin quota, a
        client has at most that many predictions outstanding (the rest are
        dropped), and a client whose predictions go almost all unused (moving
        share > WASTE_LIMIT) may start one read per token: a flood of
        predictions can neither sweep the cache nor monopolise the readers."""
        s = self._session(routing)
        return {"queued": self._predict(s, self._keys(msg, "keys", unique=False))}

    def _predict(self, s: Session, keys) -> int:
        keys = list(dict.fromkeys(keys))
        if self.cfg.pin_quota:
            room = self.cfg.pin_quota - len(self.store.predictions.get(s.client_id, ()))
            if s.pf_waste > WASTE_LIMIT:
                room = min(room, 1 - s.pf_started)
            keys = [k for k in keys if k not in self.store.key_slot][:max(0, room)]
        started = self.store.predict(s.client_id, keys)
        s.pf_started += len(started)
        self._start_loads(started, urgent=False)
        return len(started)

    def op_begin_token(self, routing, msg, frame):
        """begin_token {} -> {epoch, released}: next epoch; the previous epoch's pins go."""
        s = self._session(routing)
        released, unused = self.store.end_epoch(s.client_id, s.holder)
        s.pfu += unused
        if s.pf_started:
            s.pf_waste = 0.8 * s.pf_waste + 0.2 * min(1.0, unused / s.pf_started)
        s.pf_started = 0
        s.epoch += 1
        return {"epoch": s.epoch, "released": released}

    def op_heartbeat(self, routing, msg, frame):
        """heartbeat {client_id, gen?} -> no reply; renews the client's lease.

        A heartbeat for another generation (queued while this daemon was
        restarting) is ignored: its client_id names someone else here."""
        if msg.get("gen", self.gen) != self.gen:
            return NO_REPLY
        s = self.by_id.get(msg.get("client_id")) if type(msg.get("client_id")) is int else None
        if s is not None:
            s.last_seen = time.monotonic()
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

    # -- reads -----------------------------------------------------------------
    def _start_loads(self, slots: list[int], urgent: bool, owner: int | None = None) -> None:
        if not slots:
            return
        parts = parts_per_key(self.readers.threads, len(slots), self.source.max_parts)
        jobs = []
        for slot in slots:
            extents = self.source.keys[self.store.slot_key[slot]]
            groups = split_extents(extents, parts)
            self.store.loads[slot].parts_left = len(groups)
            dest = self.arena.view(slot)
            jobs.extend(Job(slot, i, g, dest, self.source) for i, g in enumerate(groups))
        if owner is None or not urgent:
            self.readers.submit(jobs, urgent)
        else:
            self.fair.submit(jobs, owner)

    def _apply_done(self) -> None:
        done = self.readers.done
        now = time.monotonic()
        while True:
            try:
                d = done.get_nowait()
            except queue.Empty:
                return
            load = self.store.loads[d.load_id]
            load.parts_left -= 1
            self.fair.part_done(d.load_id, d.part)
            if d.error and load.fail is None:
                load.fail = d.error
            self.stats.bytes_read += d.nbytes
            self.stats.read_seconds += d.seconds
            self.recent.add(now, d.nbytes)
            if load.parts_left:
                continue
            cancelled = bool(load.fail) and self._draining
            self.store.complete(d.load_id, load.fail, counted=not cancelled)
            if load.fail and not cancelled:
                log.warning("read of expert (layer %d, expert %d) failed: %s", *load.key, load.fail)
            for p in self.waiters.pop(d.load_id, ()):
                if p.done:
                    continue
                if load.fail:
                    p.done = True
                    if p.session.alive and cancelled:   # the client re-attaches after a restart
                        self._send_error(p.session.routing, p.rid, errors.ShuttingDown("the daemon is shutting down"))
                    elif p.session.alive:
                        self._send_error(p.session.routing, p.rid, errors.ReadFailed(
                            f"reading expert (layer {load.key[0]}, expert {load.key[1]}) from "
                            f"{self.source.path} failed: {load.fail}; the next fetch retries"))
                    continue
                p.left.discard(d.load_id)
                if not p.left:
                    p.done = True
                    if p.session.alive:
                        try:
                            slots = self._checked_slots(p.keys, p.slots)
                            if p.session.holder != p.holder:
                                # The client began a new token before this reply (a pipelining
                                # client): its old pins are gone, so pin for the token it reads in,
                                # within that token's quota like any fetch in it.
                                self._repin(p.session, slots)
                            self._send(p.session.routing, p.rid, {"slots": slots})
                            self.latency.record(p.result, time.monotonic() - p.t0)
                        except K3Error as e:
                            self._send_error(p.session.routing, p.rid, e)

    def _repin(self, s: Session, slots: list[int]) -> None:
        policy, quota = self.store.policy, self.store.pin_quota
        if quota:
            after = len(policy.held(s.holder) | set(slots))
            if after > quota:
                raise errors.QuotaExceeded(
                    f"pin quota exceeded: this fetch, answered after begin_token, would pin {after} slots "
                    f"in the new token, the quota is {quota} per client per token; fetch it again")
        for slot in slots:
            policy.pin(slot, s.holder)

    def _checked_slots(self, keys, slots) -> list[int]:
        st = self.store
        for key, slot in zip(keys, slots):
            if st.state[slot] != READY or st.slot_key[slot] != key:
                raise errors.K3Error(
                    f"expert (layer {key[0]}, expert {key[1]}) was released before the fetch finished "
                    "(begin_token during a fetch?); fetch it again")
        return slots

    # -- arena handout ----------------------------------------------------------
    def _hand_out_arena(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:   # EMFILE/ENFILE: this client waits; everyone else is served
                log.warning("cannot accept an arena connection: %s", e)
                return
            with conn:
                conn.setblocking(False)
                try:
                    uid, gid, pid = unix_peer_cred(conn)
                except OSError:
                    continue
                if not peer_allowed(uid, gid, pid):
                    log.warning("refused the arena to uid %d gid %d pid %d: not allowed", uid, gid, pid)
                    try:
                        conn.send(refusal(uid, gid, pid).encode())
                    except OSError:
                        pass
                    continue
                meta = pack({"gen": self.gen, "arena_bytes": self.arena.size,
                             "slot_bytes": self.arena.slot_bytes, "slots": self.arena.slots})
                try:
                    socket.send_fds(conn, [meta], [self.arena.fd])
                except OSError as e:
                    log.warning("could not hand out the arena: %s", e)

    # -- clients ----------------------------------------------------------------
    def _reap(self, now: float) -> None:
        for s in list(self.sessions.values()):
            reason = None
            if s.pid is not None:
                try:
                    ticks = start_ticks(s.pid)
                except OSError as e:      # cannot tell now (fds exhausted): ask again next round
                    log.debug("liveness of pid %s unknown: %s", s.pid, e)
                    continue
                if ticks is None:
                    reason = "exited"
                elif ticks != s.started:
                    reason = "exited (pid reused)"
            lease = max(self.cfg.lease_s, s.lease_s)
            if reason is None and now - s.last_seen > lease:
                reason = f"silent for {now - s.last_seen:.1f}s (lease {lease:g}s)"
            if reason:
                self._drop(s, reason, dead=True)

    def _drop(self, s: Session, reason: str, dead: bool) -> None:
        released, _ = self.store.end_epoch(s.client_id, s.holder)
        # Its held-back reads go on as background reads (another client may fetch
        # those keys: that promotes them), never ahead of the urgent reads of others.
        for job in self.fair.release(s.client_id, urgent=False):
            self.store.loads[job.load_id].urgent = False     # so a fetch of its key promotes it
        s.alive = False
        # A fetch it still waits on is answered now (a live process whose lease ran
        # out must not wait for its own timeout to learn it is no longer attached).
        for pending in {id(p): p for ps in self.waiters.values() for p in ps}.values():
            if pending.session is s and not pending.done:
                pending.done = True
                self._send_error(s.routing, pending.rid, NotAttached(
                    f"the daemon dropped this client ({reason}) before the fetch finished; "
                    "its pins are released: connect again"))
        self.sessions.pop(s.routing, None)
        self.by_id.pop(s.client_id, None)
        if dead:
            self.stats.clients_dead += 1
            log.warning("client %s (pid %s) %s: released %d pins", s.name, s.pid, reason, released)
        else:
            log.info("client %s (pid %s) %s: released %d pins", s.name, s.pid, reason, released)

    # -- status -------------------------------------------------------------------
    def status(self) -> dict:
        now = time.monotonic()
        st = self.stats
        urgent, background = self.readers.queued()
        return {
            "state": "serving",
            "version": __version__,
            "protocol": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "gen": self.gen,
            "uptime_s": round(now - self.t0, 3),
            "endpoint": self.cfg.endpoint,
            "model": self.source.describe(),
            "arena": {"bytes": self.arena.size, "slots": self.arena.slots,
                      "slot_bytes": self.arena.slot_bytes, "expert_bytes": self.source.expert_bytes,
                      "page_bytes": self.arena.page_bytes,
                      "thp_bytes": self.arena.thp_bytes, **self.store.gauges()},
            "stats": st.as_dict(),
            "fetch_seconds": self.latency.as_dict(),
            "readers": {"threads": self.readers.threads, "queued_urgent": urgent,
                        "queued_background": background,
                        "held_back": self.fair.held_back(),
                        "busy_bps": round(st.bytes_read / st.read_seconds) if st.read_seconds else 0,
                        "recent_bps": round(self.recent.rate(now))},
            "clients": [{"name": s.name, "id": s.client_id, "pid": s.pid, "epoch": s.epoch,
                         "pins": len(self.store.policy.held(s.holder)), "fetches": s.fetches,
                         "idle_s": round(now - s.last_seen, 3)}
                        for s in self.sessions.values()],
        }

    def status_line(self) -> str:
        st = self.stats
        total = st.hits + st.misses
        rate = f"{100 * st.hits / total:.1f}%" if total else "-"
        g = self.store.gauges()
        return f"serving: {g['used']}/{self.arena.slots} slots, hit rate {rate}, {len(self.sessions)} clients"

    # -- shutdown -----------------------------------------------------------------
    def _shutdown(self) -> None:
        self.board.close()            # a scrape waiting on the loop gets the last snapshot now
        if self.notifier is not None:
            self.notifier.stopping()
        log.info("draining: stop accepting, cancel queued reads")
        self.listener.close()
        try:
            os.unlink(self.arena_socket)
        except FileNotFoundError:
            pass
        self._draining = True         # cancelled reads answer ShuttingDown, not ReadFailed
        self.fair.release_all()       # so that stop() cancels and reports them
        if not self.readers.stop():
            log.error("%d reader(s) still busy after 30 s; exiting without waiting for them",
                      self.readers.alive())
        self._apply_done()
        for waiting in self.waiters.values():
            for p in waiting:
                if not p.done and p.session.alive:
                    p.done = True
                    self._send_error(p.session.routing, p.rid, errors.ShuttingDown("the daemon is shutting down"))
        self.waiters.clear()
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
