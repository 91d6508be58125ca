"""Replies that cannot go as they are: counted, logged, and answered with an error where one can reach.

The real loop, over inproc with small high-water marks, so a client that does not
read its replies fills its queue after a few: the rest are dropped (the loop never
waits), every one counted in ``stats.replies_dropped`` and one warning logged; once
the client reads again it is served as before.  A reply that is too large for a
client, or cannot be encoded, goes as an error reply with the same id.
"""

from __future__ import annotations

import logging
import tempfile
import threading

import zmq

from conftest import SCRATCH
from helpers import poll_for
from k3client.protocol import MAX_REPLY_BYTES, PROTOCOL_VERSION, pack, unpack
from k3d.config import DEFAULT_PATTERN, resolve
from k3d.memory.arena import Arena
from k3d.serve.loop import Server
from k3d.serve.wire import Replies
from k3d.service.daemon import size_arena
from k3d.sources.safetensors import SafetensorsSource

HWM = 2


def request(op: str, rid: int, **fields) -> bytes:
    return pack({"v": PROTOCOL_VERSION, "op": op, "id": rid, **fields})


def test_replies_a_client_does_not_read_are_counted_and_warned(checkpoint, caplog):
    tmp = tempfile.mkdtemp(prefix="k3d-r-", dir=SCRATCH)
    cfg = resolve({"endpoint": f"ipc://{tmp}/k.sock", "slots": 8, "readers": 2, "state_dir": "none"}, {})
    src = SafetensorsSource(checkpoint, DEFAULT_PATTERN)
    arena = Arena(*size_arena(cfg, src.expert_bytes))
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.SNDHWM, HWM)
    router.bind("inproc://replies")
    srv = Server(cfg, src, arena, f"{tmp}/k.sock.arena", sock=router)
    deaf, observer = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    deaf.setsockopt(zmq.RCVHWM, HWM)
    for s in (deaf, observer):
        s.setsockopt(zmq.LINGER, 0)
        s.connect("inproc://replies")

    def status():
        observer.send(request("status", 0))
        assert observer.poll(10000)
        return unpack(observer.recv())["status"]["stats"]

    t = threading.Thread(target=srv.serve_forever, daemon=True)
    caplog.set_level(logging.WARNING, logger="k3d")
    t.start()
    try:
        sent = 40
        for i in range(sent):                        # answered with an error each, never read meanwhile
            deaf.send(request("no_such_op", i))
        poll_for(lambda: status()["bad_requests"] == sent, 10, "the loop to handle every request")
        got = 0
        while deaf.poll(100):
            assert unpack(deaf.recv())["error"]["code"] == "bad_request"
            got += 1
        assert 0 < got < sent
        assert status()["replies_dropped"] == sent - got     # every reply either queued or counted
        warned = [r for r in caplog.records if "queue is full" in r.getMessage()]
        assert len(warned) == 1 and warned[0].levelno == logging.WARNING, caplog.text
        deaf.send(request("status", 99))                    # reading again: served as before
        assert deaf.poll(10000) and unpack(deaf.recv())["id"] == 99
        assert status()["replies_dropped"] == sent - got
    finally:
        deaf.close()
        observer.close()
        srv.request_stop()
        t.join(10)
        arena.close()
        src.close()


def test_a_reply_that_cannot_go_becomes_an_error_reply(caplog):
    ctx = zmq.Context()
    router, client = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.bind("inproc://too-big")
    client.setsockopt(zmq.ROUTING_ID, b"c")
    client.connect("inproc://too-big")
    replies = Replies(router, gen=5)
    try:
        replies.ok(b"c", 7, {"blob": bytes(MAX_REPLY_BYTES + 1)})
        replies.ok(b"c", 8, {"thing": object()})
        replies.ok(b"c", 9, {"fine": 1})
        got = [unpack(client.recv()) for _ in range(3)]
        assert [r["id"] for r in got] == [7, 8, 9]
        assert not got[0]["ok"] and "more than a client accepts" in got[0]["error"]["message"]
        assert not got[1]["ok"] and "not encodable" in got[1]["error"]["message"]
        assert got[2] == {"id": 9, "ok": True, "gen": 5, "fine": 1}
        assert replies.dropped == 2
        assert sum("error reply goes instead" in r.getMessage() for r in caplog.records) == 2
    finally:
        client.close(0)
        router.close(0)
        ctx.term()
