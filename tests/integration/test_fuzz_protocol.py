"""Fuzz the message decoder of a real daemon: random and mutated msgpack frames.

One raw DEALER socket sends, one at a time: random bytes, random msgpack
values (hypothesis strategies drawn with a printed seed), valid requests with
fields mutated (wrong types, huge ints, nested junk, unknown ops, wrong
version), byte-level mutations of valid frames (flips, truncations,
splices), multi-frame and empty messages, an over-limit frame.  Each must be
answered within 1 s; junk with an error reply, the few mutations that still
decode to a valid request with a normal reply.  Every 50 frames a
well-behaved k3client fetches and verifies bytes; at the end the daemon still
serves, counted the bad requests, and leaked nothing.
"""

import os
import random
import time

import msgpack
import numpy as np
import zmq

import k3client
from helpers import poll_for
from k3client.protocol import MAX_MESSAGE_BYTES, PROTOCOL_VERSION, pack, unpack

VALID = [
    {"v": PROTOCOL_VERSION, "op": "status", "id": 1},
    {"v": PROTOCOL_VERSION, "op": "hello", "id": 2, "name": "fuzz", "pid": 1},
    {"v": PROTOCOL_VERSION, "op": "fetch", "id": 3, "keys": [[0, 1], [0, 2]], "predicted": [[1, 3]]},
    {"v": PROTOCOL_VERSION, "op": "predict", "id": 4, "keys": [[2, 5]]},
    {"v": PROTOCOL_VERSION, "op": "begin_token", "id": 5},
    {"v": PROTOCOL_VERSION, "op": "bye", "id": 6},
]
JUNK = [None, True, -1, 2**63 - 1, -2**63, 2**64 - 1, 1.5, float("nan"), "", "x" * 5000, b"\x00" * 10,
        [], [[]], [[0]], [[0, 1, 2]], [["a", "b"]], [[-1, -1]], [[10**9, 0]], [[0, 1]] * 5000,
        {"a": 1}, [None], [[True, False]], [[0.5, 1]], list(range(100))]

def random_tree(rng, depth=0):
    """A random msgpack-able value: scalars, strings, bytes, nested lists and maps."""
    r = rng.random()
    if depth > 3 or r < 0.5:
        return rng.choice([None, True, False, rng.randint(-2**64, 2**64 - 1), rng.uniform(-1e9, 1e9),
                           "".join(chr(rng.randint(0, 0x2FF)) for _ in range(rng.randint(0, 20))),
                           os.urandom(rng.randint(0, 20))])
    if r < 0.75:
        return [random_tree(rng, depth + 1) for _ in range(rng.randint(0, 5))]
    return {rng.choice(["v", "op", "id", "keys", "name", str(rng.random())]): random_tree(rng, depth + 1)
            for _ in range(rng.randint(0, 5))}


def mutate_fields(rng) -> bytes:
    msg = dict(rng.choice(VALID))
    for _ in range(rng.randint(1, 3)):
        field = rng.choice(list(msg) + ["keys", "predicted", "op", "v", "id", "name", "extra"])
        if rng.random() < 0.2:
            msg.pop(field, None)
        else:
            msg[field] = rng.choice(JUNK + ["fetch", "status", "nope", "__init__", "_handle"])
    try:
        return pack(msg)
    except (OverflowError, ValueError, TypeError):
        return b"\xc1"


def mutate_bytes(rng) -> bytes:
    raw = bytearray(pack(rng.choice(VALID)))
    kind = rng.randrange(4)
    if kind == 0:
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
    elif kind == 1:
        raw = raw[:rng.randrange(len(raw))]
    elif kind == 2:
        i = rng.randrange(len(raw))
        raw[i:i] = os.urandom(rng.randint(1, 8))
    else:
        raw = raw + pack(rng.choice(VALID))          # two messages glued together
    return bytes(raw)


def random_value(rng) -> bytes:
    v = random_tree(rng) if rng.random() < 0.5 else rng.choice(JUNK)
    try:
        return msgpack.packb(v, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return b"\xc1"


def heartbeat_like(raw: bytes) -> bool:
    """A frame that decodes to a well-formed heartbeat: the daemon answers those with silence."""
    try:
        m = unpack(raw)
    except Exception:
        return False
    return (isinstance(m, dict) and m.get("op") == "heartbeat" and type(m.get("id")) is int
            and m.get("v") == PROTOCOL_VERSION)


def test_fuzzed_frames_get_error_replies_and_daemon_keeps_serving(checkpoint, start_daemon):
    seed = int(os.environ.get("K3D_TEST_SEED", random.randrange(1 << 30)))
    print(f"seed {seed} (rerun with K3D_TEST_SEED={seed})")
    rng = random.Random(seed)
    d = start_daemon(checkpoint, "--slots", "24")
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(d.endpoint)
    good = k3client.connect(d.endpoint, name="good")
    ref = {}
    counts = {"error": 0, "ok": 0}
    slowest = 0.0
    try:
        for i in range(1500):
            kind = i % 5
            if kind == 0:
                frames = [os.urandom(rng.randint(0, 64))]
            elif kind == 1:
                frames = [random_value(rng)]
            elif kind == 2:
                frames = [mutate_fields(rng)]
            elif kind == 3:
                frames = [mutate_bytes(rng)]
            else:
                frames = rng.choice([[b""], [pack(VALID[0]), pack(VALID[0])], [b"", b"", b""],
                                     [os.urandom(16), b"x"]])
            if len(frames) == 1 and heartbeat_like(frames[0]):
                continue
            t0 = time.monotonic()
            s.send_multipart(frames)
            assert s.poll(1000), f"no answer within 1 s to frame #{i} {frames!r:.200}"
            reply = unpack(s.recv())
            slowest = max(slowest, time.monotonic() - t0)
            assert isinstance(reply, dict) and "gen" in reply and "ok" in reply
            if reply["ok"]:
                counts["ok"] += 1
                assert len(frames) == 1 and unpack(frames[0])["op"] in {m["op"] for m in VALID}
            else:
                counts["error"] += 1
                assert reply["error"]["code"] and reply["error"]["message"]
                assert "internal error" not in reply["error"]["message"], reply
            if i % 50 == 0:
                good.begin_token()
                for ex in good.fetch(i % 4, [i % 16, (i + 7) % 16]):
                    a = ex.array("w2.weight_packed").copy()
                    ref.setdefault((ex.layer, ex.expert), a)
                    assert np.array_equal(a, ref[(ex.layer, ex.expert)])
        # the fuzz socket's session, if a fuzzed hello made one, ends now: after the frame below
        # the socket reconnects under another routing id, and a bye from there ends nothing
        # (its session would keep any pins it took until its lease runs out)
        s.send(pack({"v": PROTOCOL_VERSION, "op": "bye", "id": 99}))   # the fuzz socket's session, if any
        assert s.poll(1000)
        unpack(s.recv())
        # one frame over the limit: ZeroMQ ends the connection unanswered (MAXMSGSIZE);
        # the socket reconnects and its next request is answered
        s.send(b"\x00" * (MAX_MESSAGE_BYTES + 1))
        s.send(pack({"v": PROTOCOL_VERSION, "op": "status", "id": 98}))
        assert s.poll(10000)
        assert unpack(s.recv())["id"] == 98
        print(f"{counts['error']} error replies, {counts['ok']} ok, slowest {slowest * 1000:.1f} ms")
        assert counts["error"] > 1000
        st = good.status()
        assert st["stats"]["bad_requests"] >= counts["error"] // 2
        assert st["arena"]["loading"] == 0
        good.begin_token()
        poll_for(lambda: good.status()["arena"]["pinned"] == 0, 3, lambda: f"no pins: {good.status()['arena']}",
                 interval=0.05)
    finally:
        good.close()
        s.close(0)
        ctx.term()
    assert d.stop() == 0
    assert "Traceback" not in d.log()
