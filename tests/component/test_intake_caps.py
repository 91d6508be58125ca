"""Bounded intake (k3d/serve/intake.py, wire.py "Limits") in the real loop over ipc.

A raw DEALER floods the daemon with thousands of requests and reads none of its
replies, while a ``k3client`` (hits through the daemon, so every fetch crosses the
loop) keeps fetching and checking bytes.  The flooder's waiting requests stay at
most ``MAX_QUEUED`` (status shows them), the ones over the cap are answered with the
one-line refusal, its replies past the high-water mark are dropped and counted, and
the other client is answered throughout.  A flood of hit reports is never lost,
over the cap or not.  A frame over ``MAX_MESSAGE_BYTES`` ends its sender's
connection before the loop sees it; one at the limit is answered.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

import k3client
from helpers import expert_bytes, poll_for
from k3client.protocol import MAX_MESSAGE_BYTES, PROTOCOL_VERSION, pack, unpack
from k3d.commands.ctl import render
from k3d.serve.wire import MAX_QUEUED
from servers import Servers

REFUSAL = f"more than {MAX_QUEUED} requests queued from this client; wait for replies before sending more"


@pytest.fixture
def server(checkpoint):
    servers = Servers(checkpoint, prefix="k3d-q-")
    yield servers.start()
    servers.close()


def request(op: str, rid: int, **fields) -> bytes:
    return pack({"v": PROTOCOL_VERSION, "op": op, "id": rid, **fields})


def attach(ctx, endpoint: str, name: str, hit_path: bool = False):
    """A DEALER that said hello (so its requests are an attached client's), and the hello reply."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    s.send(request("hello", 0, name=name, pid=os.getpid(), hit_path=hit_path))
    assert s.poll(10000)
    reply = unpack(s.recv())
    assert reply["ok"], reply
    return s, reply


def raw_client(ctx, endpoint: str, hit_path: bool = False):
    return attach(ctx, endpoint, "flood", hit_path)[0]


def drain(s) -> list[dict]:
    out = []
    while s.poll(200):
        out.append(unpack(s.recv()))
    return out


def test_a_flooding_client_is_refused_and_bounded_while_another_is_served(server):
    ctx = zmq.Context()
    flood = raw_client(ctx, server.cfg.endpoint)
    stop = threading.Event()
    sent = [0]

    def flooder():                       # thousands of fetches, none of its replies read
        i = 1
        while not stop.is_set():
            try:
                flood.send(request("fetch", i, keys=[[0, i % 4]]), zmq.NOBLOCK)
                i += 1
            except zmq.Again:            # ZeroMQ's back-pressure: the daemon reads it no faster
                stop.wait(0.001)
        sent[0] = i - 1

    t = threading.Thread(target=flooder)
    t.start()
    samples = []
    try:
        with k3client.connect(server.cfg.endpoint, name="polite", hit_path="daemon", timeout=30) as c:
            poll_for(lambda: c.status()["stats"]["requests_over_cap"] > 0, 30, "the flood to meet its cap")
            for n in range(60):
                c.begin_token()
                layer = 1 + n % 3          # (the flood pins 4 experts of layer 0 and never lets go)
                for ex in c.fetch(layer, [n % 16, (n + 5) % 16]):
                    want = np.frombuffer(expert_bytes(server.ref, server.source.layout, (ex.layer, ex.expert)),
                                         np.uint8)
                    assert np.array_equal(np.frombuffer(ex.memory(), np.uint8), want)
                if n % 10 == 0:
                    st = c.status()
                    samples += [x["queued"] for x in st["clients"] if x["name"] == "flood"]
            assert t.is_alive(), "the flood ended before the other client finished"
            # until its replies overflow what ZeroMQ and the kernel buffer for it
            poll_for(lambda: c.status()["stats"]["replies_dropped"] > 0, 60, "a reply to the flood dropped")
            stop.set()
            t.join(30)
            replies = drain(flood)
            st = c.status()
    finally:
        stop.set()
        t.join(30)
        flood.close()
        ctx.term()
    assert samples and max(samples) <= MAX_QUEUED, samples
    errors = [r["error"] for r in replies if not r["ok"]]
    assert errors and all(e == {"code": "bad_request", "message": REFUSAL} for e in errors), errors[:3]
    assert any(r["ok"] for r in replies)
    me = next(x for x in st["clients"] if x["name"] == "flood")
    assert me["over_cap"] == st["stats"]["requests_over_cap"] > 0
    assert me["queued"] <= MAX_QUEUED
    flood_line = next(ln for ln in render(st).splitlines() if ln.strip().startswith("flood "))
    assert f"{me['over_cap']} requests refused: too many waiting" in flood_line, flood_line
    # every request the loop took was answered or its reply dropped and counted (the rest
    # were still on their way when the flood stopped)
    assert len(replies) + st["stats"]["replies_dropped"] <= sent[0]


def test_hit_reports_over_the_cap_are_applied_not_lost(server):
    ctx = zmq.Context()
    s = raw_client(ctx, server.cfg.endpoint, hit_path=True)
    try:
        s.send(request("fetch", 1, keys=[[0, 1]]))
        assert s.poll(10000)
        slot = unpack(s.recv())["slots"][0]
        report = [[0, [1], [slot]]]
        n = 400
        for i in range(n):               # reports and fetches carrying reports, unread: many over the cap
            op, fields = ("hits", {}) if i % 2 else ("fetch", {"keys": [[0, 1]]})
            s.send(request(op, 100 + i, hits=report, **fields))
        st = {}

        def applied():
            st.update(status(s))
            return st["stats"]["client_hits"] == n

        poll_for(applied, 30, lambda: f"every report applied: {st['stats']}")
        assert st["stats"]["requests_over_cap"] > 0
    finally:
        s.close()
        ctx.term()


def status(s) -> dict:
    """The daemon's status, asked on ``s`` (other replies waiting on it are skipped; asked
    again while the request finds the cap full)."""
    s.send(request("status", 7))
    while s.poll(10000):
        r = unpack(s.recv())
        if r["id"] == 7 and r["ok"]:
            return r["status"]
        if r["id"] == 7:
            assert r["error"]["message"] == REFUSAL, r
            s.send(request("status", 7))
    raise AssertionError("no status reply")


def frame_of(size: int) -> bytes:
    """A status request of exactly ``size`` bytes, within the daemon's decode limits
    (strings of at most 4 KiB in one list)."""
    pad = ["x" * 4000] * ((size - len(request("status", 1, pad=[]))) // 4003)
    last = size - len(request("status", 1, pad=pad))
    while len(m := request("status", 1, pad=[*pad, "y" * last])) > size:
        last -= 1
    assert len(m) == size
    return m


def test_a_frame_over_the_limit_ends_the_connection_and_one_at_it_is_answered(server):
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    mon = s.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    s.connect(server.cfg.endpoint)
    try:
        at_limit = frame_of(MAX_MESSAGE_BYTES)
        s.send(at_limit)
        assert s.poll(10000) and unpack(s.recv())["ok"]
        s.send(at_limit + b"\x00")
        events = []
        while zmq.EVENT_DISCONNECTED not in events:
            assert mon.poll(10000), events
            events.append(recv_monitor_message(mon)["event"])
        assert not s.poll(0)              # never answered
        s.send(request("status", 2))      # the socket reconnects: served as before
        assert s.poll(10000) and unpack(s.recv())["id"] == 2
        with pytest.raises(k3client.BadRequest, match="exceeds the daemon's 1048576 byte limit"):
            with k3client.connect(server.cfg.endpoint, name="big") as c:
                c._call("predict", keys=[[0, 1]] * (MAX_MESSAGE_BYTES // 3))
    finally:
        mon.close()
        s.close()
        ctx.term()
