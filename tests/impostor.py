"""A process that is not the k3d daemon but answers at its endpoint, for the client's trust tests.

``python impostor.py ENDPOINT KIND [HELLO_JSON]`` binds a ROUTER at the ipc
``ENDPOINT``, answers ``hello`` with a reply shaped as the daemon's (one tiny
layout, a 4-slot arena; ``HELLO_JSON`` overrides its fields, e.g. a real
daemon's layout, ``slots`` and ``slot_bytes``), and hands out two fds over
``ENDPOINT.arena`` as the daemon does.  ``KIND`` says what is wrong with what it hands out:

- ``sealed``: nothing (memfds sealed as the daemon seals them): the control;
- ``unsealed-arena`` / ``unsealed-index``: that memfd carries no seal;
- ``file``: the arena is a regular file opened O_RDONLY, not a memfd;
- ``other-uid``: sealed memfds, but the arena socket listens as ``nobody``
  (bound as root, then the process drops to uid 65534 before ``listen``: the
  listener's credentials are what SO_PEERCRED reports).  Needs root.

Prints ``ready`` once both sockets listen, then answers until SIGTERM.  One
thread; the hand-out is served between ZeroMQ polls.
"""

import fcntl
import json
import os
import signal
import socket
import sys
import tempfile

import zmq

from k3client.index import index_bytes
from k3client.layout import TensorSpec
from k3client.protocol import PROTOCOL_VERSION, pack, unpack
from k3d.memory.index import SharedIndex

GEN = 4242
SLOTS, SLOT = 4, 4096
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | 0x0010 | fcntl.F_SEAL_SEAL    # FUTURE_WRITE


def memfd(size: int, sealed: bool) -> int:
    fd = os.memfd_create("impostor", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if sealed:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    return fd


def main(endpoint: str, kind: str, overrides: dict) -> None:
    path = endpoint[len("ipc://"):]
    layout = [TensorSpec("w", "F32", (16,), 0, 64).to_wire()]
    hello = {"client_id": 1, "layout": layout, "slots": SLOTS, "slot_bytes": SLOT, "expert_bytes": SLOT,
             "arena_socket": path + ".arena", "lease_s": 10.0, "model": {"path": "impostor"}, **overrides}
    size = hello["arena_bytes"] = hello["slots"] * hello["slot_bytes"]
    if kind == "file":
        f = tempfile.NamedTemporaryFile(dir=os.path.dirname(path), delete=False)
        f.write(b"\0" * size)
        f.close()
        arena = os.open(f.name, os.O_RDONLY)
        os.unlink(f.name)
    else:
        arena = memfd(size, kind != "unsealed-arena")
    if kind == "unsealed-index":
        index, index_size = memfd(index_bytes(1, 4), False), index_bytes(1, 4)
    else:
        shared = SharedIndex(1, 4)
        index, index_size = shared.fd, shared.size
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(endpoint)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".arena")
    if kind == "other-uid":
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    listener.listen(8)
    listener.setblocking(False)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("ready", flush=True)
    hello["index_bytes"] = index_size
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    poller.register(listener.fileno(), zmq.POLLIN)
    try:
        while True:
            events = dict(poller.poll(1000))
            if listener.fileno() in events:
                conn, _ = listener.accept()
                with conn:
                    meta = pack({"gen": GEN, "arena_bytes": size, "index_bytes": index_size,
                                 "slot_bytes": hello["slot_bytes"], "slots": hello["slots"]})
                    try:
                        socket.send_fds(conn, [meta], [arena, index])
                    except OSError:          # the client refused before reading (EPIPE): the next one
                        pass
            if router in events:
                routing, body = router.recv_multipart()
                msg = unpack(body)
                if msg.get("op") == "heartbeat":
                    continue
                fields = hello if msg.get("op") == "hello" else {}
                router.send_multipart([routing, pack({"id": msg.get("id"), "ok": True, "gen": GEN,
                                                      "v": PROTOCOL_VERSION, **fields})])
    finally:
        router.close(0)
        listener.close()
        ctx.term()
        for p in (path, path + ".arena"):
            try:
                os.unlink(p)
            except OSError:
                pass


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]) if len(sys.argv) > 3 else {})
