"""CPU fair share between clients (k3d/serve/pacing.py) in a real daemon.

Every fetch goes through the daemon here (``hit_path="daemon"``: hits answered in
the client cost the daemon nothing to share).  Four polite clients fetch a few
experts per layer with a pause between layers,
as a model computing does; a fifth sends big fetches and floods predictions
as fast as it is answered.  The daemon must hold the flooder back (status:
``paced``, ``paced_s``; ``stats.paced``), never a polite client, serve
everyone's bytes exactly, and with ``--max-share 0`` hold nobody back.
"""

from __future__ import annotations

import random
import threading
import time

import k3client
from helpers import reference, verify
from k3d.commands.ctl import render

POLITE, SECONDS = 4, 3.0


def run_clients(endpoint, ref, quota):
    stop = threading.Event()
    errors: list = []
    counts: dict = {}

    def polite(i):
        rng = random.Random(i)
        with k3client.connect(endpoint, name=f"polite{i}", hit_path="daemon") as c:
            while not stop.is_set():
                c.begin_token()
                for layer in range(4):
                    verify(c, c.fetch(layer, rng.sample(range(16), 2)), ref)
                    counts[i] = counts.get(i, 0) + 1
                    time.sleep(0.005)

    def flood():
        rng = random.Random(99)
        with k3client.connect(endpoint, name="flood", hit_path="daemon") as c:
            while not stop.is_set():
                c.begin_token()
                verify(c, c.fetch(rng.randrange(4), rng.sample(range(16), quota)), ref)
                counts["flood"] = counts.get("flood", 0) + 1
                c.predict([(rng.randrange(4), rng.randrange(16)) for _ in range(256)])

    def guarded(fn, *a):
        try:
            fn(*a)
        except Exception as e:   # noqa: BLE001 -- reported by the test below
            errors.append(repr(e))

    threads = [threading.Thread(target=guarded, args=(polite, i)) for i in range(POLITE)]
    threads.append(threading.Thread(target=guarded, args=(flood,)))
    for t in threads:
        t.start()
    time.sleep(SECONDS)
    with k3client.connect(endpoint, name="observer") as c:
        st = c.status()
    stop.set()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return st, counts


def by_name(st):
    return {c["name"]: c for c in st["clients"]}


def test_a_flooding_client_is_held_back_and_the_polite_ones_are_not(checkpoint, start_daemon):
    d = start_daemon(checkpoint, "--slots", "48", "--pin-quota", "12")
    st, counts = run_clients(d.endpoint, reference(checkpoint), quota=12)
    clients = by_name(st)
    assert clients["flood"]["paced"] > 0 and clients["flood"]["paced_s"] > 0, clients["flood"]
    for i in range(POLITE):
        assert clients[f"polite{i}"]["paced"] == 0, clients[f"polite{i}"]
        assert clients[f"polite{i}"]["cpu_share"] < clients["flood"]["cpu_share"]
    assert st["stats"]["paced"] >= clients["flood"]["paced"] > 0
    assert st["stats"]["paced_seconds"] >= clients["flood"]["paced_s"] - 0.001   # rounded to ms there
    assert counts["flood"] > 0          # held back, never shut out
    # k3ctl status shows it: each client's CPU share, the flooder's holds
    lines = {ln.split()[0]: ln for ln in render(st).splitlines() if ln.startswith("  ")}
    assert "held back" in lines["flood"] and " cpu " in lines["flood"]
    assert "held back" not in lines["polite0"] and " cpu " in lines["polite0"]
    assert "holds of clients over their CPU share" in render(st)


def test_max_share_zero_holds_nobody_back(checkpoint, start_daemon):
    d = start_daemon(checkpoint, "--slots", "48", "--pin-quota", "12", "--max-share", "0")
    st, _ = run_clients(d.endpoint, reference(checkpoint), quota=12)
    assert st["stats"]["paced"] == 0 and all(c["paced"] == 0 for c in st["clients"])
    assert all(c["cpu_share"] == 0 for c in st["clients"])    # off: nothing is even measured
