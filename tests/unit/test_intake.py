"""The loop's intake (k3d/serve/intake.py): holds decided by the pacer reach the turns,
and each client's waiting requests are capped (bounded intake, wire.py "Limits").

The pacing tests need no socket past ``receive``: requests are put in ``turns`` as
``receive`` puts them (arrival time, frames), with real sessions and counters.
The cap's tests use the daemon's real ROUTER (``open_endpoint``) over inproc.
"""

import time

from helpers import module_doc
from k3d.cache.sessions import Sessions
from k3d.config import Live
from k3d.observe.stats import Counters
from k3d.serve.intake import Intake
from k3d.serve.pacing import MAX_DELAY


def setup(n):
    sessions, stats = Sessions(), Counters()
    intake = Intake(None, sessions, stats, Live(max_share=2.0))
    clients = [sessions.attach(f"r{i}".encode(), f"c{i}", None, None, time.monotonic(), 10.0) for i in range(n)]
    return intake, clients, stats


def push(intake, s, tag):
    intake.turns.push(s.routing, (time.monotonic(), tag), 1)


def test_a_client_over_its_share_is_held_then_served_and_the_others_are_not():
    intake, cs, stats = setup(6)
    for s in cs[1:]:
        intake.charge(s.client_id, 0.02)
    intake.charge(cs[0].client_id, 0.5)        # 25x the others
    assert intake.turns.held_until(cs[0].routing) > time.monotonic() and cs[0].paced == 1 and stats.paced == 1
    assert 0 < cs[0].paced_s <= MAX_DELAY and stats.paced_seconds == cs[0].paced_s
    assert all(s.paced == 0 for s in cs[1:])
    push(intake, cs[0], "heavy")
    push(intake, cs[1], "light")
    now = time.monotonic()
    assert intake.next(now)[1] == "light"
    assert intake.next(now) is None            # only the held request waits
    wait_ms = intake.poll_ms()
    assert 1 <= wait_ms <= MAX_DELAY * 1000 + 1
    assert intake.next(intake.turns.held_until(cs[0].routing) + 0.001)[1] == "heavy"


def test_a_hold_is_never_stretched_by_more_charges():
    intake, cs, _ = setup(6)
    for s in cs[1:]:
        intake.charge(s.client_id, 0.02)
    intake.charge(cs[0].client_id, 0.5)
    until = intake.turns.held_until(cs[0].routing)
    intake.charge(cs[0].client_id, 5.0)        # its reads report while it is held
    assert intake.turns.held_until(cs[0].routing) == until and cs[0].paced == 1


def test_leaving_lifts_the_hold_and_forgets_the_usage():
    intake, cs, _ = setup(6)
    for s in cs[1:]:
        intake.charge(s.client_id, 0.02)
    intake.charge(cs[0].client_id, 0.5)
    push(intake, cs[0], "heavy")
    assert intake.next(time.monotonic()) is None
    intake.left(cs[0], dead=False)
    assert intake.pacer.usage(cs[0].client_id, time.monotonic()) == 0
    assert intake.next(time.monotonic())[1] == "heavy"     # not dead: its request is still answered


def test_a_dead_clients_requests_go_and_a_gone_clients_reads_are_not_charged():
    intake, cs, _ = setup(3)
    push(intake, cs[2], "x")
    intake.sessions.remove(cs[2])
    intake.left(cs[2], dead=True)
    assert intake.waiting == 0
    intake.charge(cs[2].client_id, 1.0)
    assert intake.pacer.usage(cs[2].client_id, time.monotonic()) == 0


def test_the_share_is_read_from_the_live_settings_at_each_use():
    intake, cs, stats = setup(6)
    intake.live.max_share = 0.0                 # a SIGHUP turned pacing off: nothing is charged or held
    assert not intake.pacing
    for s in cs[1:]:
        intake.charge(s.client_id, 0.02)
    intake.charge(cs[0].client_id, 0.5)
    assert intake.turns.held_until(cs[0].routing) == 0.0 and stats.paced == 0
    intake.live.max_share = 2.0                 # and back on: the same charges hold the heavy client
    for s in cs[1:]:
        intake.charge(s.client_id, 0.02)
    intake.charge(cs[0].client_id, 0.5)
    assert intake.turns.held_until(cs[0].routing) > time.monotonic() and stats.paced == 1


# -- bounded intake (wire.py "Limits") -------------------------------------------------
def flood_setup(name: str):
    """A real ROUTER with the daemon's options and two DEALERs over inproc (a message is
    in the ROUTER's queue when ``send`` returns), and an intake whose loop handler
    records what it is given over the cap."""
    import zmq

    from k3d.serve.wire import open_endpoint

    ctx = zmq.Context()
    router = open_endpoint(ctx, f"inproc://{name}")
    over = []
    intake = Intake(router, Sessions(), Counters(), Live(max_share=0.0),
                    handle=lambda routing, s, frames, t, over_cap: over.append((routing, frames[0].bytes)))
    peers = []
    for rid in (b"flood", b"calm"):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.ROUTING_ID, rid)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"inproc://{name}")
        peers.append(s)
    return ctx, router, intake, over, peers


def test_a_client_gets_at_most_max_queued_waiting_and_the_rest_goes_to_over_cap():
    from k3d.serve.wire import MAX_QUEUED

    ctx, router, intake, over, (flood, calm) = flood_setup("cap")
    try:
        sent = 0
        for i in range(3 * MAX_QUEUED):          # the ROUTER takes RCVHWM + the DEALER's SNDHWM
            flood.send(str(i).encode())
            sent += 1
        calm.send(b"calm")
        passes = 0
        while intake.queued(b"calm") == 0 or len(over) < MAX_QUEUED:
            before = len(over)
            intake.receive()
            passes += 1
            assert len(over) - before <= 1          # one over the cap ends the pass
            assert intake.queued(b"flood") <= MAX_QUEUED
            assert passes < 10 * sent, "the intake stopped taking messages"
        assert intake.queued(b"flood") == MAX_QUEUED and intake.queued(b"calm") == 1
        assert intake.stats.requests_over_cap == len(over)
        # in arrival order: the first MAX_QUEUED queued, the next ones over the cap, one per pass
        assert [m for _, m in over[:3]] == [str(MAX_QUEUED + i).encode() for i in range(3)]
        assert {r for r, _ in over} == {b"flood"}
        assert intake.next(time.monotonic())[1] in (b"flood", b"calm")
    finally:
        for s in (flood, calm, router):
            s.close(0)
        ctx.term()


def test_the_endpoint_socket_carries_the_documented_limits():
    import zmq

    from k3client import protocol
    from k3d.serve import wire

    ctx = zmq.Context()
    sock = wire.open_endpoint(ctx, "inproc://limits")
    try:
        assert sock.getsockopt(zmq.MAXMSGSIZE) == protocol.MAX_MESSAGE_BYTES == 1 << 20
        assert sock.getsockopt(zmq.RCVHWM) == wire.MAX_QUEUED
        assert sock.getsockopt(zmq.SNDHWM) == wire.REPLY_HWM == 2 * wire.MAX_QUEUED
    finally:
        sock.close(0)
        ctx.term()
    # the docstrings state the same numbers
    assert "(1 MiB)" in module_doc(wire) and "1 MiB" in protocol.__doc__
    assert f"at most {wire.MAX_QUEUED} requests" in protocol.__doc__


def test_a_request_over_the_frame_limit_is_refused_before_it_is_sent():
    import pytest

    from k3client.errors import BadRequest
    from k3client.protocol import MAX_MESSAGE_BYTES, pack_request

    fits = {"op": "status", "pad": "x" * 70000}     # (a str32 already: its header size is final)
    fits["pad"] += "x" * (MAX_MESSAGE_BYTES - len(pack_request(fits)))
    assert len(pack_request(fits)) == MAX_MESSAGE_BYTES
    fits["pad"] += "x"
    with pytest.raises(BadRequest, match="^status request of 1048577 bytes exceeds the daemon's 1048576 byte"):
        pack_request(fits)
