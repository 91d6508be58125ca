"""Client processes for the pacing test: polite model processes and one abuser.

Each is a process of its own, so the daemon, the polite clients and the abuser
compete for the CPUs as model processes do (no GIL shared between them).  They
share one schedule on the system-wide monotonic clock: from ``T0`` on, phases of
``PHASE`` seconds, the abuser abusing in the odd ones and silent in the even ones.
Both attach, print ``ready`` and read the schedule from stdin: one line
``T0 PHASE PHASES``.

``python tests/pacing_clients.py polite ENDPOINT CKPT NAME SEED``: attached with
``hit_path="daemon"`` (every fetch a round trip), until the last phase ends, runs
tokens of 4 layers (2 experts per layer, a 5 ms pause between layers, as a model
computing does), verifies every fetched byte against the checkpoint, and prints
one JSON line: ``{"fetches": [[start, seconds], ...], "session": ...}``, every
fetch's start (on the monotonic clock) and latency, and its own entry of the
daemon's status.

``python tests/pacing_clients.py abuser ENDPOINT KEYS WINDOW``: a raw DEALER
socket (hello, then requests it packed once), so that its harm does not hang on
how often this machine schedules it.  In every odd phase it keeps ``WINDOW``
predictions of ``KEYS`` keys in flight (each costs the daemon's loop about 2 ms
of decoding and checking), sending the next as soon as one is answered: unpaced,
the loop always has one of them to serve, and a polite fetch waits behind it.
Prints one JSON line: ``{"tokens": N, "status": ...}``, the predictions answered
and the daemon's status.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zmq  # noqa: E402

import k3client  # noqa: E402
from helpers import reference, verify  # noqa: E402
from k3client.protocol import PROTOCOL_VERSION, pack, unpack  # noqa: E402


def schedule() -> tuple[float, float, int]:
    print("ready", flush=True)
    t0, phase, phases = sys.stdin.readline().split()
    return float(t0), float(phase), int(phases)


def polite(endpoint, ckpt, name, seed):
    ref, rng, out = reference(ckpt), random.Random(int(seed)), []
    # every fetch a round trip: pacing shares out the daemon's time, which hits a client
    # answers from the shared index never take
    with k3client.connect(endpoint, name=name, hit_path="daemon") as c:
        t0, phase, phases = schedule()
        end = t0 + phase * phases
        while time.monotonic() < end:
            c.begin_token()
            for layer in range(4):
                keys = rng.sample(range(16), 2)
                start = time.monotonic()
                experts = c.fetch(layer, keys)
                out.append([start, time.monotonic() - start])
                verify(c, experts, ref)
                time.sleep(0.005)
        session = next(e for e in c.status()["clients"] if e["name"] == name)
    print(json.dumps({"fetches": out, "session": session}), flush=True)


def abuser(endpoint, keys, window):
    rng, tokens = random.Random(99), 0
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)

    def ask(op, **fields):
        sock.send(pack({"v": PROTOCOL_VERSION, "op": op, "id": 1, **fields}))
        reply = unpack(sock.recv())
        assert reply["ok"], reply
        return reply

    ask("hello", name="abuser", pid=os.getpid())
    # one message, packed once: the abuser's own CPU goes to sending, not to building keys
    msg = pack({"v": PROTOCOL_VERSION, "op": "predict", "id": 2,
                "keys": [[rng.randrange(4), rng.randrange(16)] for _ in range(int(keys))]})
    t0, phase, phases = schedule()
    for k in range(1, phases, 2):
        start, stop = t0 + k * phase, t0 + (k + 1) * phase
        time.sleep(max(0.0, start - time.monotonic()))
        out = 0
        while time.monotonic() < stop:
            for _ in range(int(window) - out):
                sock.send(msg)
            out = int(window)
            if sock.poll(max(1, int((stop - time.monotonic()) * 1000))):
                assert unpack(sock.recv())["ok"]
                out -= 1
                tokens += 1
        for _ in range(out):         # the ones still in flight, answered as the quiet phase starts
            assert unpack(sock.recv())["ok"]
    status = ask("status")["status"]
    ask("bye")
    sock.close()
    ctx.term()
    print(json.dumps({"tokens": tokens, "status": status}), flush=True)


if __name__ == "__main__":
    {"polite": polite, "abuser": abuser}[sys.argv[1]](*sys.argv[2:])
