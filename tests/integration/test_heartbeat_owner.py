"""A heartbeat renews only the lease of a client its sender owns (the real daemon).

Two clients attach with raw sockets from this process and then say nothing on
them.  ``own`` is kept alive the way k3client's lease thread does it: heartbeats
from another socket of the same process.  ``victim`` gets heartbeats naming its
client_id from another process, which owns no session of that id: they must not
renew it, so the victim is dropped when its lease runs out, while ``own``, silent
just as long, stays attached.
"""

from __future__ import annotations

import subprocess
import sys
import time

import zmq

from helpers import poll_for
from k3client.protocol import PROTOCOL_VERSION, pack, unpack

LEASE = 1.0

FORGER = r"""
import sys, time, zmq
from k3client.protocol import PROTOCOL_VERSION, pack
endpoint, client_id, gen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = zmq.Context().socket(zmq.DEALER)
s.setsockopt(zmq.LINGER, 0)
s.connect(endpoint)
print("beating", flush=True)
while True:
    s.send(pack({"v": PROTOCOL_VERSION, "op": "heartbeat", "id": 0, "client_id": client_id, "gen": gen}))
    time.sleep(LEASE / 10)
""".replace("LEASE", repr(LEASE))


def test_a_heartbeat_renews_only_a_client_its_sender_owns(checkpoint, start_daemon):
    d = start_daemon(checkpoint, "--arena", "4MiB", "--lease", str(LEASE))
    ctx = zmq.Context()
    socks = []

    def sock():
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(d.endpoint)
        socks.append(s)
        return s

    def ask(s, op, **fields):
        s.send(pack({"v": PROTOCOL_VERSION, "op": op, "id": 1, **fields}))
        assert s.poll(10000), d.log()
        return unpack(s.recv())

    def attached():
        return {c["id"] for c in ask(observer, "status")["status"]["clients"]}

    observer = sock()
    victim = ask(sock(), "hello", name="victim", pid=0)
    own = ask(sock(), "hello", name="own", pid=0)
    beat = sock()                       # this process's lease socket for `own`
    forger = subprocess.Popen([sys.executable, "-c", FORGER, d.endpoint, str(victim["client_id"]),
                               str(victim["gen"])], stdout=subprocess.PIPE, text=True)
    try:
        assert forger.stdout.readline().strip() == "beating"

        def victim_dropped():
            beat.send(pack({"v": PROTOCOL_VERSION, "op": "heartbeat", "id": 0,
                            "client_id": own["client_id"], "gen": own["gen"]}))
            time.sleep(LEASE / 10)
            assert forger.poll() is None
            return victim["client_id"] not in attached()

        poll_for(victim_dropped, 8 * LEASE,
                 lambda: f"the victim's lease to run out despite another process's heartbeats:\n{d.log()}")
        assert own["client_id"] in attached(), d.log()
        assert "victim" in d.log() and "silent for" in d.log()
    finally:
        forger.kill()
        forger.wait(10)
        for s in socks:
            s.close()
        ctx.term()
