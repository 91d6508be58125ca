"""The loop's intake: requests off the socket, in turn, and each client's CPU charged.

Three steps, in the order the server loop takes them (``wait`` first, until
there is something to do):
- ``receive``: the requests waiting on the ROUTER socket (up to ``RECV_BATCH``
  per loop pass) go into ``turns`` (one queue per client, by routing id), each
  stamped with its arrival time (fetch latency counts from it).  A lone request
  (nothing queued, nothing more on the socket, its client not held) skips the
  turns: they would hand it straight back.  A client may have at most
  ``wire.MAX_QUEUED`` requests waiting (bounded intake, below);
- ``next``: the request to handle now, chosen by deficit round-robin
  (``turns.py``), passing by clients that are held back; None while only held
  clients' requests wait;
- ``charge``: the CPU seconds spent for a client (the loop's for its request,
  measured around the handler; a reader's for its read) go to ``pacing.Pacer``
  (in bills of ``BILL_S``),
  and a client far over its share is held in ``turns`` until its rate has
  fallen (``pacing.py`` says why and how long).  Holds are counted on the
  session (``paced``, ``paced_s``) and in the counters (``paced``,
  ``paced_seconds``).

Bounded intake: a request that finds ``MAX_QUEUED`` of its client's requests
waiting is not queued but handled at once (``over_cap``, through the loop's
``_handle``): its hit reports are applied (a client's reports are never lost:
its views depend on them); a heartbeat is handled and a ``hits`` message is then
done (no reply, as ever; its ``seen`` is not applied out of turn); any other op
is answered with a one-line ``bad_request`` ("more than N requests queued from
this client; wait for replies before sending more").  Counted in
``requests_over_cap`` (and the session's ``over_cap``).  A refusal, not a hold,
because ROUTER hands the loop its peers' messages in turn: the loop cannot leave
one peer's messages on the socket and read the others', so a held client's
further messages would have to be kept, without bound.  A ``k3client`` waits for the reply to each
request, so only hit reports can queue behind one (a client the pacer holds
while it answers many hits itself); it meets the cap only then, and loses
nothing.  Handling one over the cap ends the pass (the loop serves a request
in turn before it reads on), and when nothing may be served then, the loop
reads the socket again only after ``REFUSED_PAUSE_MS``: a client that floods is
read about once per pause while nothing else waits, and ZeroMQ's back-pressure
(``RCVHWM``) keeps the rest in its own process.  Others' requests may wait that
pause once while a flood goes on; the loop's CPU stays theirs.

``poll_ms`` is how long the loop may sleep in poll: 0 while a request may be
handled now, until the first held client's release while only held ones
wait, else ``IDLE_MS`` (housekeeping).  With nothing waiting and no read in
flight the loop does not poll: it waits in ``receive(block=True)``, up to the
socket's RCVTIMEO, which the server sets to ``IDLE_MS``.  After a refusal (see
above) it polls the readers' eventfd alone until the pause ends.

Thread: the server thread owns all of it (``charge`` for a read is called from
``Cache.apply_done``, on the same thread).
"""

from __future__ import annotations

import time

import zmq

from k3d.serve import wire
from k3d.serve.pacing import Pacer
from k3d.serve.turns import Turns, cost_of

RECV_BATCH = 256         # requests taken off the socket per loop pass, at most
IDLE_MS = 100            # the longest the loop sleeps: housekeeping runs at least this often
BILL_S = 0.001           # CPU seconds a client runs up before the pacer hears of them
REFUSED_PAUSE_MS = 1     # after a refusal with nothing to serve: the socket is read again this much later


class Intake:
    def __init__(self, sock: zmq.Socket, sessions, stats, live, handle=None):
        """``live``: the daemon's live settings (``k3d.config.Live``); pacing reads ``max_share``.
        ``handle(routing, session, frames, arrival, over_cap=True)`` handles a request over
        its client's cap (above)."""
        self.sock, self.sessions, self.stats = sock, sessions, stats
        self.handle = handle
        self.turns = Turns()
        self.live = live
        self.pacer = Pacer(live)
        self._direct = None      # a lone request, not held: served next without queueing
        self._poller = None      # made at the first poll (``wait``)
        self._pause_poller = None  # the readers' eventfd alone (the pause after a refusal)
        self._refused = False    # this pass met a client's cap: ``wait`` pauses unless one may be served

    @property
    def waiting(self) -> int:
        return self.turns.waiting + (self._direct is not None)

    def wait(self, reads) -> None:
        """Wait for what the loop must act on, then ``receive``.  While a read of
        ``reads`` (``k3d.reads.loads.Loads``) is in flight or a request waits its turn,
        poll the socket beside the readers' eventfd; else only a message can need the
        loop, so wait in a blocking receive, several times cheaper than a poll
        (``k3d.serve.loop``, "How it waits").  After a refusal with nothing to
        serve, only the readers are waited on, for ``REFUSED_PAUSE_MS``."""
        if self._refused:
            self._refused = False
            if not (self._direct is not None or self.turns.ready(time.monotonic())):
                if self._pause_poller is None:
                    self._pause_poller = zmq.Poller()
                    self._pause_poller.register(reads.wake_fd, zmq.POLLIN)
                if self._poll(self._pause_poller, REFUSED_PAUSE_MS, reads) is None:
                    return
        if self.waiting or reads.in_flight():
            if self._poller is None:
                self._poller = zmq.Poller()
                self._poller.register(self.sock, zmq.POLLIN)
                self._poller.register(reads.wake_fd, zmq.POLLIN)
            events = self._poll(self._poller, self.poll_ms(), reads)
            if events is not None and self.sock in events:
                self.receive()
        else:
            self.receive(block=True)

    @staticmethod
    def _poll(poller, ms: int, reads) -> dict | None:
        """``poller``'s events within ``ms``, the readers' wake-up taken; None: interrupted."""
        try:
            events = dict(poller.poll(ms))
        except zmq.ZMQError as e:
            if e.errno == zmq.EINTR:
                return None
            raise
        if reads.wake_fd in events:
            reads.drain_wake()
        return events

    def receive(self, block: bool = False) -> None:
        """Take the requests waiting on the socket into ``turns``; ``block``: wait for
        the first one (up to the socket's RCVTIMEO).  The socket's EVENTS says whether
        another request waits: asking it is cheaper than a recv failing with zmq.Again
        (bench/README.md, "intake").  The loop's own wake-ups are taken and dropped."""
        sock, turns = self.sock, self.turns
        for _ in range(RECV_BATCH):
            got = wire.receive(sock, block)
            if got is None:
                return
            block = False
            routing, frames = got
            more = wire.more_waiting(sock)
            if routing == wire.WAKE_ID:
                if not more:
                    return
                continue
            now = time.monotonic()
            if not more and not turns.waiting and self._direct is None and turns.held_until(routing) <= now:
                # Alone and not held: the turns would hand it straight back (an empty ring
                # serves its only request at once, whatever its cost), so skip them.
                self._direct = (now, routing, frames)
                return
            if self.queued(routing) >= wire.MAX_QUEUED:
                self.over_cap(routing, frames, now)
                return
            size = sum(len(f.buffer) for f in frames)
            turns.push(routing, (now, routing, frames), cost_of(size))
            if not more:
                return

    def over_cap(self, routing: bytes, frames, now: float) -> None:
        """Handle a request that found its client's cap full (above): counted, its loop CPU
        charged, and the pass ends with a pause unless a request may be served."""
        self._refused = True
        self.stats.requests_over_cap += 1
        s = self.sessions.get(routing)
        cpu = time.thread_time()
        self.handle(routing, s, frames, now, over_cap=True)
        if s is not None:
            s.over_cap += 1
            if self.pacing:
                self.charge_session(s, time.thread_time() - cpu)

    def queued(self, routing: bytes) -> int:
        """How many of ``routing``'s requests wait to be handled."""
        d = self._direct
        return self.turns.queued(routing) + (d is not None and d[1] == routing)

    def next(self, now: float):
        """(arrival time, routing id, body frames) of the request to handle now, or None."""
        if self._direct is not None:
            item, self._direct = self._direct, None
            return item
        return self.turns.pop(now)

    def poll_ms(self) -> int:
        if self._direct is not None:
            return 0
        if not self.turns.waiting:
            return IDLE_MS
        now = time.monotonic()
        if self.turns.ready(now):
            return 0
        release = self.turns.next_release()
        return IDLE_MS if release is None else max(1, min(IDLE_MS, int((release - now) * 1000) + 1))

    @property
    def pacing(self) -> bool:
        """Whether clients are charged at all (``--max-share 0``: nothing is measured)."""
        return self.live.max_share > 0

    def charge(self, client_id: int, cpu: float) -> None:
        """``charge_session`` for ``client_id`` (a read's client, which may have left meanwhile)."""
        if self.live.max_share > 0:
            s = self.sessions.by_id.get(client_id)
            if s is not None:
                self.charge_session(s, cpu)

    def charge_session(self, s, cpu: float) -> None:
        """``cpu`` seconds were spent for session ``s``; hold it back while it is far over its share.

        The pacer hears of a client's CPU in bills of at least ``BILL_S``: deciding a
        hold per request would cost the loop more than many requests do, and a
        millisecond is nothing against the pacer's one-second memory."""
        s.unbilled += cpu
        if s.unbilled < BILL_S:
            return
        cpu, s.unbilled = s.unbilled, 0.0
        client_id = s.client_id
        now = time.monotonic()
        self.pacer.charge(client_id, cpu, now)
        if self.turns.held_until(s.routing) > now:   # held already: a hold is never stretched (MAX_DELAY holds)
            return
        wait = self.pacer.delay(client_id, now)
        if not wait:
            return
        s.paced += 1
        s.paced_s += wait
        self.stats.paced += 1
        self.stats.paced_seconds += wait
        self.turns.hold(s.routing, now + wait)

    def left(self, s, dead: bool) -> None:
        """Session ``s`` ended: its usage and hold go; if it died, its waiting requests too
        (nobody to answer them)."""
        self.pacer.forget(s.client_id, time.monotonic())
        self.turns.release(s.routing)
        if dead:
            self.turns.forget(s.routing)
            if self._direct is not None and self._direct[1] == s.routing:
                self._direct = None
