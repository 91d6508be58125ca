"""Fair share of the server loop between clients (k3d/serve/turns.py wired into the real loop).

Two raw DEALER clients queue requests before the loop runs: one floods big
requests (512 keys each), the other sends small ones.  The loop must serve the
small client's requests in the turns between the big ones, by cost, not one
for one in arrival order.  The order is observed at ``Server._handle``.
"""

from __future__ import annotations

import tempfile
import threading
import time

import zmq

from conftest import SCRATCH
from k3client.protocol import PROTOCOL_VERSION, pack
from k3d.config import DEFAULT_PATTERN, resolve
from k3d.memory.arena import Arena
from k3d.serve.loop import Server
from k3d.service.daemon import size_arena
from k3d.sources.safetensors import SafetensorsSource


def test_a_flood_of_big_requests_does_not_starve_small_ones(checkpoint):
    tmp = tempfile.mkdtemp(prefix="k3d-f-", dir=SCRATCH)
    cfg = resolve({"endpoint": f"ipc://{tmp}/k.sock", "slots": 8, "readers": 2, "state_dir": "none"}, {})
    src = SafetensorsSource(checkpoint, DEFAULT_PATTERN)
    n, sb = size_arena(cfg, src.expert_bytes)
    arena = Arena(n, sb)
    srv = Server(cfg, src, arena, f"{tmp}/k.sock.arena")
    order = []
    handle = srv._handle

    def observed(routing, *rest):
        order.append(routing)
        return handle(routing, *rest)
    srv._handle = observed
    ctx = zmq.Context()
    big, small = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    big.setsockopt(zmq.ROUTING_ID, b"big")
    small.setsockopt(zmq.ROUTING_ID, b"small")
    for s in (big, small):
        s.setsockopt(zmq.LINGER, 0)
        s.connect(cfg.endpoint)
    keys = [[0, e % 16] for e in range(512)]
    for i in range(20):       # queued before the loop runs: it sees them all waiting
        big.send(pack({"v": PROTOCOL_VERSION, "op": "predict", "id": i, "keys": keys}))
    for i in range(20):
        small.send(pack({"v": PROTOCOL_VERSION, "op": "predict", "id": i, "keys": [[0, 1]]}))
    time.sleep(0.5)           # let ZeroMQ's I/O thread deliver them to the ROUTER
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        for s in (big, small):
            for _ in range(20):
                assert s.poll(10000)
                s.recv()
        assert len(order) == 40
        # every small request is served before the flood's fourth big one (arrival order, or
        # one for one, would put the last small one after the 19th big one)
        last_small = max(i for i, r in enumerate(order) if r == b"small")
        assert order[:last_small].count(b"big") <= 3, order
    finally:
        srv.request_stop()
        t.join(10)
        big.close()
        small.close()
        ctx.term()
        arena.close()
        src.close()
