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

``python tests/pacing_clients.py abuser ENDPOINT KEYS``: in every odd phase, sends
tokens of one ``predict`` of KEYS random keys, as fast as it is answered (each one
costs the daemon milliseconds); prints one JSON line: ``{"tokens": N, "status":
...}``, the tokens it got through and the daemon's status.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import k3client  # noqa: E402
from helpers import reference, verify  # noqa: E402


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


def abuser(endpoint, keys):
    rng, tokens = random.Random(99), 0
    # through the daemon too: with the shared index the client would drop the keys
    # already resident, and its 4096-key predictions would cost the daemon nothing
    with k3client.connect(endpoint, name="abuser", hit_path="daemon") as c:
        t0, phase, phases = schedule()
        for k in range(1, phases, 2):
            start, stop = t0 + k * phase, t0 + (k + 1) * phase
            time.sleep(max(0.0, start - time.monotonic()))
            while time.monotonic() < stop:
                c.begin_token()
                c.predict([(rng.randrange(4), rng.randrange(16)) for _ in range(int(keys))])
                tokens += 1
        status = c.status()
    print(json.dumps({"tokens": tokens, "status": status}), flush=True)


if __name__ == "__main__":
    {"polite": polite, "abuser": abuser}[sys.argv[1]](*sys.argv[2:])
