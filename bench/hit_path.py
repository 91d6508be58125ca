"""Hit path: ``fetch`` of 8 resident experts vs a bare pyzmq DEALER/ROUTER echo.

    python bench/hit_path.py [--iters 1500] [--reps 7] [--block 25] [--hit-path client|daemon] [--explain]

Floor: a Python ROUTER echo server in its own process, answering a DEALER
client over ipc (blocking send/recv, no decoding, no logic) with a reply of
the size of a real fetch reply, to a request of the size of a real fetch
request.  Measured: ``begin_token()`` (not timed) then ``fetch(0, 8 experts)``
(timed), all 8 resident, so every key is a hit (checked in the stats).
Echo round trips and fetches alternate in blocks of ``--block`` requests, so
the VM's drifting speed hits both alike while each path stays warm, as in a
decode loop; ``--block 1`` alternates one by one, where both pay a process
wake-up per request.  p50/p99 are medians over reps; the ratio is the median
of the per-rep p50 ratios.  ``--pin`` puts this process on CPU 0 and both
servers on CPU 1.  ``--explain`` adds a ladder from the bare echo to
the real fetch (client-side work, server-loop shape) to show where time goes.
``--hit-path daemon`` measures the round trip every fetch made before the
shared index (and still makes where the CPU lacks its ordering).

Target: fetch p50 <= 0.3x echo p50 with the default hit path (answered in the
client), <= 1.5x with ``--hit-path daemon``.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
import zmq  # noqa: E402

from k3client.protocol import PROTOCOL_VERSION, pack, unpack  # noqa: E402

N_KEYS = 8
TARGETS = {"client": 0.3, "daemon": 1.5}


def fetch_messages(n_keys: int) -> tuple[bytes, bytes]:
    """Bytes of a typical fetch request and its reply (what k3client/k3d put on the wire)."""
    req = pack({"v": PROTOCOL_VERSION, "op": "fetch", "id": 1234,
                "keys": [[0, e] for e in range(n_keys)]})
    rep = pack({"id": 1234, "ok": True, "gen": random.getrandbits(62) | 1,
                "slots": list(range(n_keys))})
    return req, rep


def echo_server(endpoint: str, reply_size: int, mode: str = "bare") -> None:
    """ROUTER: answer every request with ``reply_size`` bytes, until a b"stop" frame.

    ``mode`` "bare" is the floor.  "loop" (``--explain`` only) mimics the shape of
    k3d's server loop without its handler: a Poller over the ROUTER, an eventfd
    and a listening Unix socket; recv_multipart(NOBLOCK, copy=False) until
    zmq.Again; msgpack unpack of the request and pack of a reply dict."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.bind(endpoint)
    reply = fetch_messages(N_KEYS)[1]       # a real fetch reply (decodable by --explain's client side)
    reply += b"\0" * max(0, reply_size - len(reply))
    print("ready", flush=True)
    if mode == "bare":
        while True:
            routing, body = s.recv_multipart()
            s.send_multipart([routing, reply])
            if body == b"stop":
                break
    else:
        import socket as so

        from k3client.protocol import unpack

        efd = os.eventfd(0, os.EFD_NONBLOCK)
        lis = so.socket(so.AF_UNIX, so.SOCK_SEQPACKET)
        lis.bind(endpoint[len("ipc://"):] + ".l")
        lis.listen(4)
        poller = zmq.Poller()
        poller.register(s, zmq.POLLIN)
        poller.register(efd, zmq.POLLIN)
        poller.register(lis.fileno(), zmq.POLLIN)
        gen = random.getrandbits(62) | 1
        stop = False
        while not stop:
            events = dict(poller.poll(100))
            if s in events:
                while True:
                    try:
                        frames = s.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    raw = frames[1].bytes
                    stop = raw == b"stop"
                    msg = unpack(raw) if not stop else {"id": 0}
                    s.send_multipart([frames[0].bytes, pack({"id": msg["id"], "ok": True, "gen": gen,
                                                             "slots": list(range(N_KEYS))})], zmq.NOBLOCK)
            time.monotonic()
        lis.close()
    s.close(0)
    ctx.term()


class ClientLike:
    """k3client's request path (dict, pack, poll, recv, unpack, id/gen check,
    Expert-like objects) against an echo server: isolates the client's cost."""

    def __init__(self, sock):
        self.sock, self.rid = sock, 0

    def begin_token(self):
        pass

    def fetch(self, layer, experts):
        self.rid += 1
        self.sock.send(pack({"v": PROTOCOL_VERSION, "op": "fetch", "id": self.rid,
                             "keys": [[int(layer), int(e)] for e in experts]}))
        deadline = time.monotonic() + 120
        if not self.sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            raise TimeoutError
        reply = unpack(self.sock.recv())
        reply.get("id"), reply.get("gen"), reply.get("ok")
        return [(layer, e, s) for e, s in zip(experts, reply.get("slots") or experts)]


def explain(a, req: bytes, rep: bytes, client, keys) -> None:
    """Ladder from the bare echo to the real fetch, each step in its own process pair."""
    rows = []
    for label, mode, use_client_like in (("A bare echo (floor)", "bare", False),
                                         ("B + k3client-style request/reply", "bare", True),
                                         ("C + k3d-style server loop, no handler", "loop", True)):
        srv = harness.EchoServer(len(rep), mode)
        ctx = zmq.Context()
        es = ctx.socket(zmq.DEALER)
        es.setsockopt(zmq.LINGER, 0)
        es.connect(srv.endpoint)
        cl = ClientLike(es)
        ratios, step50 = [], []
        try:
            for _ in range(a.reps):
                if use_client_like:
                    e, f = run_blocks(None, req, cl, keys, a.iters, a.block, other=client)
                else:
                    e, f = run_blocks(es, req, client, keys, a.iters, a.block)
                step50.append(harness.pct(e, 50))
                ratios.append(harness.pct(f, 50) / step50[-1])
            es.send(b"stop")
            es.recv()
        finally:
            es.close(0)
            ctx.term()
            srv.close()
        rows.append((label, harness.median(step50), harness.median(ratios)))
    print("hit_path --explain: p50 of each step, alternating in blocks with the real fetch; "
          "fetch/step = median over reps of the per-rep p50 ratio")
    for label, p, r in rows:
        print(f"  {label:42s} {p * 1e6:6.0f}us   fetch/step {r:.2f}")


def run_blocks(sock, req: bytes, client, keys: list[int], iters: int, block: int, other=None):
    """``iters`` echo round trips and ``iters`` fetches, alternating in blocks of ``block``
    so both see the same VM (a block keeps each path warm, as a decode loop would).
    With ``sock=None`` the "echo" side is ``client`` (a ClientLike) and the fetch side ``other``."""
    echo, fetch = [], []
    pc = time.perf_counter
    real = other if sock is None else client
    for _ in range(max(1, iters // block)):
        for _ in range(block):
            if sock is None:
                t0 = pc()
                client.fetch(0, keys)
            else:
                t0 = pc()
                sock.send(req)
                sock.recv()
            echo.append(pc() - t0)
        for _ in range(block):
            real.begin_token()
            t0 = pc()
            real.fetch(0, keys)
            fetch.append(pc() - t0)
    return echo, fetch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=1500)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--block", type=int, default=25, help="alternate echo and fetch every BLOCK requests")
    ap.add_argument("--pin", action="store_true",
                    help="pin this process to CPU 0 and the daemon and echo server to CPU 1 "
                         "(steadier, not deployment-like)")
    ap.add_argument("--hit-path", choices=("client", "daemon"), default="client",
                    help="client: resident experts answered from the shared index (the default); "
                         "daemon: every fetch a round trip")
    ap.add_argument("--explain", action="store_true",
                    help="also run a ladder from the bare echo to the real fetch, to see where the time goes")
    ap.add_argument("--echo-server", nargs="+", metavar="ARG", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.echo_server:
        echo_server(a.echo_server[0], int(a.echo_server[1]), *a.echo_server[2:])
        return 0

    import k3client

    if a.pin:
        os.sched_setaffinity(0, {0})
        harness.SERVER_CPUS = {1}
    req, rep = fetch_messages(N_KEYS)
    ckpt = harness.checkpoint(layers=2, experts=16, hidden=512, inter=256, seed=1)
    try:
        with harness.EchoServer(len(rep)) as echo, \
                harness.Daemon(ckpt, "--slots", 32, "--log-level", "warning") as d, \
                k3client.connect(d.endpoint, name="bench-hit", hit_path=a.hit_path) as c:
            ctx = zmq.Context()
            es = ctx.socket(zmq.DEALER)
            es.setsockopt(zmq.LINGER, 0)
            es.connect(echo.endpoint)
            keys = list(range(N_KEYS))
            c.fetch(0, keys)                      # load: every later fetch is 8 hits
            st0 = c.status()["stats"]
            run_blocks(es, req, c, keys, 300, a.block)      # warm-up both paths
            e50, e99, f50, f99, ratios = [], [], [], [], []
            for r in range(a.reps):
                e, f = run_blocks(es, req, c, keys, a.iters, a.block)
                e50.append(harness.pct(e, 50))
                e99.append(harness.pct(e, 99))
                f50.append(harness.pct(f, 50))
                f99.append(harness.pct(f, 99))
                ratios.append(f50[-1] / e50[-1])
                harness.banner("hit_path", f"rep {r + 1}/{a.reps}: fetch p50 {f50[-1] * 1e6:.0f}us "
                               f"p99 {f99[-1] * 1e6:.0f}us | echo p50 {e50[-1] * 1e6:.0f}us "
                               f"p99 {e99[-1] * 1e6:.0f}us | "
                               f"ratio {ratios[-1]:.2f}")
            if a.explain:
                explain(a, req, rep, c, keys)
            st1 = c.status()["stats"]
            es.send(b"stop")
            es.recv()
            es.close(0)
            ctx.term()
        misses = st1["misses"] - st0["misses"]
        assert misses == 0, f"{misses} misses during the hit-path run"
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)

    p50, p99 = harness.median(f50) * 1e6, harness.median(f99) * 1e6
    ep50, ep99 = harness.median(e50) * 1e6, harness.median(e99) * 1e6
    ratio = harness.median(ratios)   # per-rep ratios follow the VM's drifting speed better than a ratio of medians
    target = TARGETS[a.hit_path]
    print(f"hit_path: request {len(req)} B, reply {len(rep)} B, {a.reps} reps x {a.iters} fetches of {N_KEYS} "
          f"resident experts (hit path {a.hit_path}), alternating with the echo in blocks of {a.block}; "
          f"medians over reps "
          f"(ratio: median of per-rep p50 ratios)")
    print(f"hit_path: p50 {p50:.0f}us p99 {p99:.0f}us echo_p50 {ep50:.0f}us echo_p99 {ep99:.0f}us "
          f"ratio {ratio:.2f} (target <= {target}) {harness.verdict(ratio <= target)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
