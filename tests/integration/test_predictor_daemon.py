"""Integration: the daemon's own predictor, in a real ``k3d start`` subprocess.

- A client that sends no predictions, ``--trace``: the daemon reads ahead for it,
  and ``k3d replay`` of the trace reproduces the daemon's counters exactly,
  including the daemon's own predictions, both from the recorded ``auto`` lines
  and by running the predictor class again.
- A client that sends its own predictions is not displaced: in every fetch its
  predictions are applied first (its trace line precedes the daemon's), and its
  own figures are kept apart from the daemon's.
- `--predict off` reads nothing ahead (neither the client's predictions nor the
  daemon's), `client` only the client's, `auto` (the default) both.
Routing is a deterministic cross-layer pattern, so there is something to learn.
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
from k3d.demo.synthetic import write_checkpoint
from k3d.observe.trace import read

LAYERS, EXPERTS = 8, 24         # above score.SMALL: the dense scoring, with recall.py's votes


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("pred")), layers=LAYERS, experts=EXPERTS,
                            hidden=256, inter=128, shards=1, seed=12)


def route(t: int) -> list[list[int]]:
    """Layer 0 picks one of six pairs; later layers follow from it (a learnable pattern)."""
    a = (t * 7) % 6
    return [[(2 * a + 5 * l) % EXPERTS, (2 * a + 5 * l + 1) % EXPERTS] for l in range(LAYERS)]


def quiet(c):
    while c.status()["arena"]["loading"]:
        time.sleep(0.002)


def drive(c, tokens: int, predict: bool) -> None:
    for t in range(tokens):
        quiet(c)
        c.begin_token()
        r = route(t)
        for layer in range(LAYERS):
            pred = [(layer + 1, r[layer + 1][0])] if predict and layer + 1 < LAYERS else None
            c.fetch(layer, r[layer], predicted=pred)
            quiet(c)       # the daemon's background reads finish: the run is the deterministic one


def replay(trace: str, predictor: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "k3d", "replay", trace, "--slots", "24", "--policy", "cycle",
                          "--predictor", predictor, "--json"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["results"]["cycle"]["24"]


def test_replay_reproduces_the_daemons_own_predictions(start_daemon, ckpt):
    trace = tempfile.mktemp(prefix="auto-", suffix=".trace", dir=SCRATCH)
    d = start_daemon(ckpt, "--slots", "24", "--trace", trace, "--state-dir", "none")    # auto: the default
    with k3client.connect(d.endpoint, name="plain") as c:
        drive(c, 60, predict=False)
        mine = c.status()["prediction"]["clients"][str(c.client_id)]
    status = query_status(d.endpoint, 5.0)
    assert d.stop() == 0
    st, auto = status["stats"], status["prediction"]["daemon"]
    assert status["predict"] == "auto" and st["loading_skips"] == 0
    assert mine["prefetched"] == 0                        # the client predicted nothing itself
    assert auto["issued"] == st["prefetched"] > 100       # ... the daemon read ahead for it
    assert auto["used"] >= 0.8 * auto["issued"]
    assert auto["used_in_time"] + auto["used_late"] == auto["used"]
    assert auto["unused_bytes"] == auto["unused"] * status["arena"]["expert_bytes"]
    assert 0 < auto["fetches"] <= 60 * LAYERS and auto["cpu_s"] > 0   # what predicting cost, timed in the daemon
    want = {k: st[k] for k in ("hits", "misses", "evictions", "prefetched", "prefetch_hits", "prefetch_unused",
                               "prefetch_refused")}
    for predictor in ("recorded", "coact"):
        got = replay(trace, predictor)
        assert {k: got[k] for k in want} == want, predictor
        assert got["auto_prefetched"] == auto["issued"] and got["auto_unused"] == auto["unused"]
    off = replay(trace, "none")
    assert off["prefetched"] == 0 and off["hit_rate"] < got["hit_rate"]


def test_a_client_predicting_itself_is_not_displaced(start_daemon, ckpt, monkeypatch):
    # every fetch a round trip, so that each fetch line has its client's predict line
    # and the daemon's auto line right after it
    monkeypatch.setenv("K3D_HIT_PATH", "daemon")
    trace = tempfile.mktemp(prefix="own-", suffix=".trace", dir=SCRATCH)
    d = start_daemon(ckpt, "--slots", "24", "--trace", trace, "--state-dir", "none", "--predict", "auto",
                     "--predict-budget", "2")
    with k3client.connect(d.endpoint, name="own") as c:
        drive(c, 40, predict=True)
        st = c.status()
        mine = st["prediction"]["clients"][str(c.client_id)]
    assert d.stop() == 0
    assert mine["prefetched"] > 0 and st["prediction"]["daemon"]["issued"] > 0
    lines = open(trace).read().splitlines()
    triples = 0
    for i, line in enumerate(lines):       # in each fetch: its own predictions first, then the daemon's
        if " predict " in line and lines[i + 1].split()[3] == "auto":
            assert " L" in lines[i - 1], lines[i - 1:i + 2]
            own = {tuple(map(int, k.split(":"))) for k in line.split()[4:]}
            auto = {tuple(map(int, k.split(":"))) for k in lines[i + 1].split()[4:]}
            assert not own & auto
            triples += 1
    assert triples > 0
    for predictor in ("recorded", "coact"):   # the client's own predictions replay as its own
        got = replay(trace, predictor)
        assert got["prefetched"] - got["auto_prefetched"] == mine["prefetched"], (predictor, got, st["stats"])


def test_a_restarted_daemon_predicts_from_its_first_token(start_daemon, ckpt):
    state = tempfile.mkdtemp(prefix="pstate-", dir=SCRATCH)
    endpoint = f"ipc://{tempfile.mkdtemp(prefix='p-', dir=SCRATCH)}/k.sock"
    args = ("--slots", "24", "--state-dir", state, "--predict", "auto")
    d = start_daemon(ckpt, *args, endpoint=endpoint)
    with k3client.connect(d.endpoint, name="before") as c:
        drive(c, 40, predict=False)
    assert d.stop() == 0
    (name,) = [f for f in os.listdir(state) if f.startswith("state-")]   # (beside it: the digest cache)
    assert json.load(open(os.path.join(state, name)))["predictor_state"]["predictor"] == "coact"
    d = start_daemon(ckpt, *args, endpoint=endpoint)
    with k3client.connect(d.endpoint, name="after") as c:
        drive(c, 1, predict=False)
        auto = c.status()["prediction"]["daemon"]
    assert d.stop() == 0
    assert auto["issued"] >= LAYERS // 2 and auto["used"] >= auto["issued"] // 2, auto


@pytest.mark.parametrize("mode", ["off", "client", "auto"])
def test_predict_modes(start_daemon, ckpt, mode):
    """``--predict off``: nothing is read ahead, neither the client's predictions nor
    the daemon's (no predict or auto lines in the trace); ``client``: only the
    client's; ``auto`` (the default, no option given): both."""
    trace = tempfile.mktemp(prefix=f"mode-{mode}-", suffix=".trace", dir=SCRATCH)
    args = () if mode == "auto" else ("--predict", mode)
    d = start_daemon(ckpt, "--slots", "24", "--trace", trace, "--state-dir", "none", *args)
    with k3client.connect(d.endpoint, name=mode) as c:
        drive(c, 30, predict=True)
        st = c.status()
        mine = st["prediction"]["clients"][str(c.client_id)]
    assert d.stop() == 0
    kinds = {ev.kind for ev in read(trace)}
    assert st["predict"] == mode
    if mode == "off":
        assert st["stats"]["prefetched"] == 0 and mine["prefetched"] == 0
        assert "daemon" not in st["prediction"] and not kinds & {"predict", "auto"}
    elif mode == "client":
        assert mine["prefetched"] > 0 and "daemon" not in st["prediction"] and "auto" not in kinds
        assert st["stats"]["prefetched"] == mine["prefetched"]
    else:
        assert mine["prefetched"] > 0 and st["prediction"]["daemon"]["issued"] > 0
        assert st["stats"]["prefetched"] == mine["prefetched"] + st["prediction"]["daemon"]["issued"]
    want = {k: st["stats"][k] for k in ("hits", "misses", "prefetched", "prefetch_unused")}
    got = replay(trace, "coact" if mode == "auto" else "none")
    assert {k: got[k] for k in want} == want
