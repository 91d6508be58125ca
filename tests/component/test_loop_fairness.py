"""Fair share of the server loop between clients (k3d/serve/turns.py wired into the real loop).

Two raw DEALER clients queue requests before the loop runs: one floods big
requests (512 keys each), the other sends small ones.  The loop must serve the
small client's requests in the turns between the big ones, by cost, not one
for one in arrival order.

Delivery is certain, not waited for: the clients reach the loop's ROUTER over
``inproc`` (bound beside its ipc endpoint), where a message is in the ROUTER's
queue when ``send`` returns, so the loop sees all of them waiting on its first
pass.  The order is read from the replies: the big requests come without hello
(each is refused, one ``bad_requests`` apiece) and the small ones ask for
``status``, whose counters say how many big requests were served before it.
"""

from __future__ import annotations

import tempfile
import threading

import zmq

from conftest import SCRATCH
from k3client.protocol import PROTOCOL_VERSION, pack, unpack
from k3d.config import DEFAULT_PATTERN, resolve
from k3d.memory.arena import Arena
from k3d.serve.loop import Server
from k3d.serve.wire import open_endpoint
from k3d.service.daemon import size_arena
from k3d.sources.safetensors import SafetensorsSource


def test_a_flood_of_big_requests_does_not_starve_small_ones(checkpoint):
    tmp = tempfile.mkdtemp(prefix="k3d-f-", dir=SCRATCH)
    cfg = resolve({"endpoint": f"ipc://{tmp}/k.sock", "slots": 8, "readers": 2, "state_dir": "none"}, {})
    src = SafetensorsSource(checkpoint, DEFAULT_PATTERN)
    n, sb = size_arena(cfg, src.expert_bytes)
    arena = Arena(n, sb)
    ctx = zmq.Context()
    router = open_endpoint(ctx, cfg.endpoint)
    router.bind("inproc://fairness")
    srv = Server(cfg, src, arena, f"{tmp}/k.sock.arena", sock=router)
    big, small = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    for s, name in ((big, b"big"), (small, b"small")):
        s.setsockopt(zmq.ROUTING_ID, name)
        s.setsockopt(zmq.LINGER, 0)
        s.connect("inproc://fairness")
    keys = [[0, e % 16] for e in range(512)]
    for i in range(20):       # queued before the loop runs: it sees them all waiting
        big.send(pack({"v": PROTOCOL_VERSION, "op": "predict", "id": i, "keys": keys}))
    for i in range(20):
        small.send(pack({"v": PROTOCOL_VERSION, "op": "status", "id": i}))
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        refused = [unpack(big.recv()) for _ in range(20) if big.poll(10000)]
        served = [unpack(small.recv()) for _ in range(20) if small.poll(10000)]
        assert len(refused) == 20 and all(r["error"]["code"] == "not_attached" for r in refused), refused[:1]
        assert len(served) == 20 and all(r["ok"] for r in served)
        before = [r["status"]["stats"]["bad_requests"] for r in served]   # big ones served before each
        # every small request is served before the flood's fourth big one (arrival order, or
        # one for one, would put the last small one after the 19th big one)
        assert before[-1] <= 3, before
    finally:
        big.close()
        small.close()
        srv.request_stop()
        t.join(10)
        arena.close()
        src.close()
