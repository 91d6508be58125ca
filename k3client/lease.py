"""The lease thread: heartbeats that keep a live client's pins, and its hit reports while it computes.

Thread: runs on its own private thread with its own DEALER socket for the
heartbeats (they must get through while the client's thread waits on a long
fetch); the hit reports go on the client's request socket, under its
attachment's ``io`` lock and only when the client's thread is not using it
(``Client._lease_sync``), so they stay in order with its requests.  It holds only
a weak reference to the client, so a dropped client ends it.  Started and
stopped by ``Client``.
"""

from __future__ import annotations

import threading

import zmq

from .protocol import PROTOCOL_VERSION, pack


def end_heartbeat(stop: threading.Event, wake: threading.Event) -> None:
    stop.set()
    wake.set()


def heartbeat(client_ref, ctx, endpoint: str, period: float, stop: threading.Event,
               wake: threading.Event) -> None:
    """Lease thread: renew the client's lease every quarter lease while it exists.

    The period follows the lease of the daemon attached now (a restarted daemon may
    have a shorter one; ``wake`` is set at every attach, so the first beat to it goes
    out at once).  While no daemon listens a beat is skipped, never queued
    (IMMEDIATE): a queue would fill in a long outage and end the thread."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.IMMEDIATE, 1)
    s.connect(endpoint)
    try:
        while True:
            wake.wait(period)
            wake.clear()
            if stop.is_set():
                return
            client = client_ref()
            if client is None:
                return
            # gen: a heartbeat queued across a restart must not renew a stranger
            client_id, gen = client._lease
            period = max(0.2, client.lease_s / 4)
            # The hit reports and the index count seen, on the client's own request
            # socket: a client computing for long then holds back only the slots it read.
            client._lease_sync()
            del client
            try:
                s.send(pack({"v": PROTOCOL_VERSION, "op": "heartbeat", "id": 0,
                             "client_id": client_id, "gen": gen}), zmq.NOBLOCK)
            except zmq.Again:       # no daemon connected right now: the next beat tries again
                pass
    except zmq.ZMQError:            # the context was terminated: the client is gone
        pass
    finally:
        s.close(0)
