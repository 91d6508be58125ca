"""Unit: the route trace format and ``k3d replay`` (pure: no daemon)."""

import json
from pathlib import Path

import pytest

from k3d import replay_cli
from k3d.cli import main as k3d_main
from k3d.replay import min_slots, run
from k3d.trace import BEGIN, FETCH, PREDICT, RouteTrace, TraceError, parse

SHARED = "/work/shared/traces/mixtral8x7b-gsm8k.trace"    # the real routing trace
needs_shared = pytest.mark.skipif(not Path(SHARED).exists(), reason=f"{SHARED} not on this machine")


def test_seed_lines_begin_a_token_where_the_layer_does_not_increase():
    lines = ["100 L0 n=2 miss=0 evict=0 wait=0 pf=0 pfu=0 7 0",
             "200 L1 n=2 miss=0 evict=0 wait=0 pf=0 pfu=0 3,6",      # the seed's comma-joined ids
             "300 L0 n=2 miss=0 evict=0 wait=0 pf=0 pfu=0 1 2"]
    ev = parse(lines)
    assert [e.kind for e in ev] == [FETCH, FETCH, BEGIN, FETCH]
    assert ev[1].keys == [(1, 3), (1, 6)] and ev[3].keys == [(0, 1), (0, 2)]
    assert {e.client for e in ev} == {0}


def test_written_lines_parse_back(tmp_path):
    path = tmp_path / "t.trace"
    t = RouteTrace(str(path), 0.0)
    t.fetch(0.001, 3, 0, [(0, 1), (0, 5), (2, 7)], 1, 0, 0, 0, 0)
    t.predict(0.001, 3, 0, [(1, 2), (1, 4)])
    t.begin(0.002, 3, 0)
    t.fetch(0.003, 3, 1, [(0, 1)], 0, 0, 0, 0, 2)
    t.bye(0.004, 3)
    t.close()
    text = path.read_text()
    assert "L0 n=3 miss=1 evict=0 wait=0 pf=0 pfu=0 1 5 2:7\n" in text
    ev = parse(text.splitlines())
    assert [e.kind for e in ev] == [FETCH, PREDICT, BEGIN, FETCH, "bye"]
    assert ev[0].keys == [(0, 1), (0, 5), (2, 7)] and ev[0].counts == (1, 0, 0, 0, 0)
    assert ev[1].keys == [(1, 2), (1, 4)] and ev[3].counts[-1] == 2


def test_epoch_growth_without_a_begin_line_is_a_new_token():
    ev = parse(["1 c=1 t=0 L0 n=1 5", "2 c=2 t=0 L0 n=1 5", "3 c=1 t=1 L0 n=1 6"])
    assert [(e.kind, e.client) for e in ev] == [(FETCH, 1), (FETCH, 2), (BEGIN, 1), (FETCH, 1)]


@pytest.mark.parametrize("line, what", [
    ("100 L0 n=2 7 x", "invalid literal"),
    ("100 L0 n=3 7 0", "n=3 but 2"),
    ("abc L0 1", "invalid literal"),
    ("100 L0 bogus=1 1", "unknown field"),
    ("100 c=1 t=0 predict", "without keys"),
])
def test_malformed_line_names_its_number(line, what):
    with pytest.raises(TraceError, match=rf"t.trace:2: malformed trace line .*{what}"):
        parse(["100 L0 n=1 1", line], "t.trace")


def test_min_slots_is_the_largest_token():
    ev = parse(["1 L0 n=2 1 2", "2 L1 n=2 1 2", "3 L0 n=1 1"])
    assert min_slots(ev) == 4
    assert run(ev, "lru", 4).misses == 4
    assert run(ev, "lru", 3).cache_full == 1       # the store refuses what cannot be pinned


@needs_shared
def test_shared_trace_figures_and_targets():
    """The issue's anchors (OPT exactly as measured there) and the default's targets."""
    ev = parse(Path(SHARED).read_text().splitlines())
    lru = {s: run(ev, "lru", s).hit_rate for s in (64, 100, 128, 192)}
    cyc = {s: run(ev, "cycle", s).hit_rate for s in (64, 100, 128, 192)}
    opt = {s: run(ev, "opt", s).hit_rate for s in (100, 128)}
    assert round(100 * opt[100], 1) == 67.1 and round(100 * opt[128], 1) == 78.2
    assert cyc[100] >= lru[100] + 0.06
    assert cyc[128] >= lru[128] + 0.04
    assert all(cyc[s] >= lru[s] - 0.01 for s in lru)
    assert all(cyc[s] <= opt[s] for s in opt)


def test_predictions_replayed_through_the_store():
    lines = []
    for t in range(20):
        for layer in range(4):
            lines.append(f"{t} c=1 t={t} L{layer} n=1 {(t + layer) % 3}")
            if layer < 3:
                lines.append(f"{t} c=1 t={t} predict {layer + 1}:{(t + layer + 1) % 3}")
        lines.append(f"{t} c=1 t={t} begin")
    ev = parse(lines)
    with_p = run(ev, "lru", 6)
    assert with_p.prefetched > 0 and with_p.prefetch_hits == with_p.prefetched and with_p.prefetch_unused == 0
    assert run(ev, "lru", 6, predictions=False).prefetched == 0


@needs_shared
def test_cli_json_shape_and_errors(capsys, tmp_path):
    assert k3d_main(["replay", SHARED, "--slots", "100,128", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["default"] == "cycle" and {"opt", "lru", "cycle"} <= set(out["results"])
    assert set(out["results"]["lru"]["100"]) >= {"hits", "misses", "evictions", "hit_rate"}
    assert k3d_main(["replay", SHARED, "--slots", "40"]) == 2
    assert "needs at least 64 slots" in capsys.readouterr().err
    assert k3d_main(["replay", SHARED, "--slots", "100", "--policy", "arc"]) == 2
    assert "known policies: cycle, lru" in capsys.readouterr().err
    bad = tmp_path / "bad.trace"
    bad.write_text("1 L0 n=1 1\n2 L1 n=1 zz\n")
    assert k3d_main(["replay", str(bad), "--slots", "4"]) == 2
    assert "bad.trace:2: malformed" in capsys.readouterr().err


@needs_shared
def test_cli_sweep_and_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "curve.png"
    assert replay_cli.main(replay_cli.add_parser(_sub()).parse_args(
        [SHARED, "--slots", "64-70", "--sweep", "--policy", "lru", "--plot", str(png)])) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["slots", "lru", "opt"] and len(out.splitlines()) == 1 + 7 + 1
    assert png.read_bytes()[:4] == b"\x89PNG"


def _sub():
    import argparse
    return argparse.ArgumentParser().add_subparsers()
