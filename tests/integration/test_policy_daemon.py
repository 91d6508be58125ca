"""Integration: the real daemon's policy is replayable, and a restart is warm.

- ``k3d start --trace`` with one client (synthetic routing with gate-ahead predictions),
  then ``k3d replay`` of that trace: the daemon's hits, misses, evictions and
  prefetch counters are reproduced exactly, for each policy.
- ``--state-dir``: after SIGTERM and a restart, the first tokens hit like the
  steady state before the restart (within 5 points); a corrupt or foreign state
  file is ignored with a log line.
Routing is seeded (``SyntheticRouter``), so every run sees the same requests.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

import pytest

import k3client
from conftest import SCRATCH
from k3d.commands.ctl import query_status
from k3d.demo.routing import SyntheticRouter
from k3d.demo.synthetic import write_checkpoint

LAYERS, EXPERTS, TOPK = 8, 16, 2


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("pol")), layers=LAYERS, experts=EXPERTS,
                            hidden=256, inter=128, shards=1, seed=11)


def quiet(c):
    """Wait until no read is in flight (so a run is the deterministic one, see k3d/cache/store.py)."""
    while c.status()["arena"]["loading"]:
        time.sleep(0.002)


def drive(c, router, tokens: int, predict: bool = True) -> None:
    for _ in range(tokens):
        quiet(c)
        c.begin_token()
        route, ahead = router.token()
        for layer in range(LAYERS):
            pred = [(layer + 1, e) for e in ahead[layer]] if predict and ahead[layer] else None
            c.fetch(layer, route[layer], predicted=pred)


@pytest.mark.parametrize("policy", ["cycle", "lru"])
def test_replay_reproduces_the_daemons_counters(start_daemon, ckpt, policy):
    trace = tempfile.mktemp(prefix="route-", suffix=".trace", dir=SCRATCH)
    d = start_daemon(ckpt, "--slots", "40", "--policy", policy, "--trace", trace, "--state-dir", "none")
    with k3client.connect(d.endpoint, name="replayed") as c:
        drive(c, SyntheticRouter(LAYERS, EXPERTS, TOPK, seed=5), 60)
        quiet(c)
    st = query_status(d.endpoint, 5.0)["stats"]       # after its bye: its last predictions counted
    assert d.stop() == 0
    assert st["loading_skips"] == 0 and st["evictions"] > 100 and st["prefetched"] > 50
    out = subprocess.run([sys.executable, "-m", "k3d", "replay", trace, "--slots", "40",
                          "--policy", policy, "--json"], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout)["results"][policy]["40"]
    want = {k: st[k] for k in ("hits", "misses", "evictions", "prefetched", "prefetch_hits", "prefetch_unused")}
    assert {k: got[k] for k in want} == want


def test_two_clients_through_the_daemon_replay_exactly(start_daemon, ckpt):
    """Two clients whose fetches all reach the daemon (``hit_path="daemon"``), interleaved layer
    by layer, evicting each other's experts: the trace replays to the daemon's counters.  (Where
    several clients answer hits themselves the daemon also evicts ahead of misses to keep a
    reserve, at times that depend on when each client has seen an eviction: a run with
    ``evicted_ahead > 0`` does not replay exactly, docs/guides/sizing.md.)"""
    trace = tempfile.mktemp(prefix="route-", suffix=".trace", dir=SCRATCH)
    d = start_daemon(ckpt, "--slots", "64", "--trace", trace, "--state-dir", "none", "--predict", "client")
    routers = [SyntheticRouter(LAYERS, EXPERTS, TOPK, seed=s) for s in (6, 7)]
    with k3client.connect(d.endpoint, name="a", hit_path="daemon") as a, \
            k3client.connect(d.endpoint, name="b", hit_path="daemon") as b:
        for _ in range(40):
            quiet(a)
            tokens = [r.token() for r in routers]
            for c in (a, b):
                c.begin_token()
            for layer in range(LAYERS):
                for c, (route, ahead) in zip((a, b), tokens):
                    pred = [(layer + 1, e) for e in ahead[layer]] if ahead[layer] else None
                    c.fetch(layer, route[layer], predicted=pred)
                    quiet(c)
    st = query_status(d.endpoint, 5.0)["stats"]
    assert d.stop() == 0
    assert st["loading_skips"] == 0 and st["evicted_ahead"] == 0 and st["evictions"] > 100
    out = subprocess.run([sys.executable, "-m", "k3d", "replay", trace, "--slots", "64", "--policy", "cycle",
                          "--predictor", "none", "--json"], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout)["results"]["cycle"]["64"]
    want = {k: st[k] for k in ("hits", "misses", "evictions", "prefetched", "prefetch_hits", "prefetch_unused")}
    assert {k: got[k] for k in want} == want


def test_status_reports_prediction_quality_per_client(start_daemon, ckpt):
    d = start_daemon(ckpt, "--slots", "40", "--state-dir", "none")
    with k3client.connect(d.endpoint, name="a") as a, k3client.connect(d.endpoint, name="b") as b:
        drive(a, SyntheticRouter(LAYERS, EXPERTS, TOPK, seed=5, stream=1), 10)
        drive(b, SyntheticRouter(LAYERS, EXPERTS, TOPK, seed=5, stream=2), 10, predict=False)
        b.status()                  # b's last hits, answered in its process, go with its next message
        st = a.status()
        pq = st["prediction"]
        qa, qb = (pq["clients"][str(c["id"])] for c in sorted(st["clients"], key=lambda c: c["name"]))
        assert qa["prefetched"] > 0 and 0 < qa["precision"] <= 1
        assert qa["precision"] == round(qa["prefetch_hits"] / qa["prefetched"], 4)   # status rounds to 4 places
        assert qb["prefetched"] == 0 and qb["precision"] is None
        for q in (qa, qb):
            assert q["ready"] + q["waited"] + q["missed"] == 10 * LAYERS * TOPK
        assert pq["total"]["prefetched"] == st["stats"]["prefetched"]
        assert pq["total"]["unused_bytes"] == st["stats"]["prefetch_unused_bytes"] == \
            st["stats"]["prefetch_unused"] * st["arena"]["expert_bytes"]
        text = subprocess.run([sys.executable, "-m", "k3d.commands.ctl", "status", "--endpoint", d.endpoint],
                              capture_output=True, text=True, check=True).stdout
        assert "precision" in text and "fetched keys ready" in text
    assert d.stop() == 0


def hit_rate(c, router, tokens: int) -> float:
    before = c.status()["stats"]
    drive(c, router, tokens)
    after = c.status()["stats"]
    hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
    return hits / (hits + misses)


def test_restart_is_warm_and_bad_state_is_ignored(start_daemon, ckpt):
    state = tempfile.mkdtemp(prefix="state-", dir=SCRATCH)
    endpoint = f"ipc://{tempfile.mkdtemp(prefix='w-', dir=SCRATCH)}/k.sock"
    router = SyntheticRouter(LAYERS, EXPERTS, TOPK, seed=9)
    args = ("--slots", "48", "--state-dir", state)
    d = start_daemon(ckpt, *args, endpoint=endpoint)
    with k3client.connect(d.endpoint, name="before") as c:
        drive(c, router, 100)
        steady = hit_rate(c, router, 20)
    assert d.stop() == 0
    every = sorted(os.listdir(state))        # its statistics, and its content digest (k3d/sources/digest.py)
    files = [f for f in every if f.startswith("state-")]
    assert len(files) == 1 and [f for f in every if not f.startswith("state-")][0].startswith("digest-")
    assert f"statistics of this checkpoint in {os.path.join(state, files[0])} (--state-dir none turns this off)" \
        in d.log()
    # the same checkpoint on another endpoint: the same file, none added
    other = start_daemon(ckpt, *args)
    assert other.stop() == 0 and sorted(os.listdir(state)) == every
    d = start_daemon(ckpt, *args, endpoint=endpoint)
    with k3client.connect(d.endpoint, name="after") as c:
        deadline = time.monotonic() + 30
        while not c.status()["warm"].get("done"):
            assert time.monotonic() < deadline, c.status()["warm"]
            time.sleep(0.01)
        warm = c.status()["warm"]
        assert warm["ready"] == warm["planned"] > 0
        first = hit_rate(c, router, 20)
    assert d.stop() == 0
    print(f"steady {100 * steady:.1f}% before the restart, first 20 tokens after it {100 * first:.1f}%")
    assert first >= steady - 0.05, (first, steady)
    # a corrupt file, then one written for another checkpoint: logged and ignored, never fatal
    path = os.path.join(state, files[0])
    good = open(path).read()
    with open(path, "w") as f:
        f.write(good[: len(good) // 2])
    d = start_daemon(ckpt, *args, endpoint=endpoint)
    with k3client.connect(d.endpoint, name="cold") as c:
        assert "planned" not in c.status()["warm"]
    assert d.stop() == 0
    assert "ignoring unreadable or corrupt state file" in d.log()
    doc = json.loads(good)
    doc["model"] = "another checkpoint"
    with open(path, "w") as f:
        json.dump(doc, f)
    d = start_daemon(ckpt, *args, endpoint=endpoint)
    assert d.stop() == 0
    assert "written for another checkpoint or layout" in d.log()
