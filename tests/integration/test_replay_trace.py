"""Integration: ``k3d replay`` on the real routing trace (Mixtral-8x7B GSM8K, traces/ in the repository).

The whole trace through the daemon's own store and policies, several arena sizes each,
and the CLI end to end (JSON, errors, a sweep with a plot): real data, so seconds of CPU,
which is why these live here and not in tests/unit with the trace format's pure tests.
Skipped where the trace is not on the machine.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import k3d
from k3d.cache.predict import DEFAULT
from k3d.commands import replay as replay_cli
from k3d.commands.cli import main as k3d_main
from k3d.observe.trace import parse
from k3d.replay.engine import run

# real routing (Mixtral-8x7B decoding GSM8K), shipped in the repository
SHARED = str(Path(__file__).resolve().parents[2] / "traces" / "mixtral8x7b-gsm8k.trace")


def test_shared_trace_figures_and_targets():
    """Anchors (OPT exactly as first measured on this trace) and the default's targets."""
    ev = parse(Path(SHARED).read_text().splitlines())
    lru = {s: run(ev, "lru", s).hit_rate for s in (64, 100, 128, 192)}
    cyc = {s: run(ev, "cycle", s).hit_rate for s in (64, 100, 128, 192)}
    opt = {s: run(ev, "opt", s).hit_rate for s in (100, 128)}
    assert round(100 * opt[100], 1) == 67.1 and round(100 * opt[128], 1) == 78.2
    assert cyc[100] >= lru[100] + 0.06
    assert cyc[128] >= lru[128] + 0.04
    assert all(cyc[s] >= lru[s] - 0.01 for s in lru)
    assert all(cyc[s] <= opt[s] for s in opt)


def _table(path, header):
    """{slots: [column %, ...]} of the markdown table under ``header`` in ``path``."""
    text = Path(path).read_text().split(header, 1)[1]
    rows = {}
    for line in text.split("\n\n", 1)[0].splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[int(cells[0])] = [float(c.strip("*% ")) for c in cells[1:] if c.strip().endswith("%") or "%" in c]
    return rows


def _shown_command(path, header) -> list[str]:
    """The arguments of the last ``k3d replay ...`` command quoted above the table under ``header``."""
    above = Path(path).read_text().split(header, 1)[0]
    return re.findall(r"`k3d (replay [^`]+)`", above)[-1].split()


def test_documented_hit_rates_are_what_replay_gives(capsys):
    """traces/README.md and the sizing guide quote the same figures, and replay reproduces them;
    traces/README.md's are what the command it shows prints."""
    root = Path(SHARED).parents[1]
    ev = parse(Path(SHARED).read_text().splitlines())
    ours = {s: [round(100 * run(ev, p, s).hit_rate, 1) for p in ("lru", "cycle", "opt")]
            for s in (64, 80, 100, 128, 160, 192)}
    header = "| slots | LRU | Belady OPT |"
    traces = _table(root / "traces" / "README.md", header)
    readme = _table(root / "docs" / "guides" / "sizing.md", "| slots | LRU | cycle (default) | OPT | cycle − LRU |")
    assert traces == {s: [v[0], v[2]] for s, v in ours.items()}, traces
    assert readme == ours, readme
    argv = _shown_command(root / "traces" / "README.md", header)
    assert argv[1] == "traces/mixtral8x7b-gsm8k.trace"
    assert k3d_main([argv[0], SHARED, *argv[2:], "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["results"]
    assert traces == {int(s): [round(100 * shown[p][s]["hit_rate"], 1) for p in ("lru", "opt")]
                      for s in shown["lru"]}


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


def test_cli_sweep_and_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "curve.png"
    assert replay_cli.main(replay_cli.add_parser(_sub()).parse_args(
        [SHARED, "--slots", "64-70", "--sweep", "--policy", "lru", "--plot", str(png)])) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0].split() == ["slots", "lru", "opt-demand"] and len(out.splitlines()) == 1 + 7 + 2
    image = png.read_bytes()
    assert image[:4] == b"\x89PNG"
    assert err == f"k3d replay: wrote {png}\n"
    # the title names the trace's file, not the folder it is in on this machine
    assert b"Title\x00k3d replay mixtral8x7b-gsm8k.trace, predictor coact" in image
    assert os.path.dirname(SHARED).encode() not in image


def test_opt_is_labelled_the_bound_without_reads_ahead(capsys):
    """With the daemon's predictor (the default) cycle passes OPT at 80 slots: OPT replays demand
    fetches only, and the table says so; without reads ahead it is the bound of every policy."""
    assert k3d_main(["replay", SHARED, "--slots", "80"]) == 0
    out = capsys.readouterr().out
    rows = {ln.split()[1]: float(re.search(r"([\d.]+)%", ln).group(1)) for ln in out.splitlines()
            if ln.startswith("   80")}
    assert rows["cycle"] > rows["opt-demand"], out
    assert out.splitlines()[-1] == ("(opt-demand: Belady's OPT under the same pins on demand fetches alone, nothing "
                                    "read ahead: the bound of a policy that reads nothing ahead; reads ahead can "
                                    "pass it)")
    assert "the daemon's own predictor: coact" in out
    assert k3d_main(["replay", SHARED, "--slots", "80", "--predictor", "none"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1].endswith("the bound, as nothing was read ahead here)")
    assert "the bound" not in out.replace("the bound, as nothing was read ahead here", "")


# a fine-grained model's real routing (Qwen3-30B-A3B, 48 x 128, top-6): the shared traces beside
# the checkout (or beside its worktrees' folder), as bench/policy_replay.py finds them
_ROOT = Path(__file__).resolve().parents[2]
QWEN = next((p for p in (_ROOT.parent / "shared", _ROOT.parent.parent / "shared")
             if (p / "traces" / "qwen3-30b-a3b-k6.trace").exists()), _ROOT.parent / "shared") / "traces" / \
    "qwen3-30b-a3b-k6.trace"


@pytest.mark.skipif(not QWEN.exists(), reason=f"{QWEN} absent")
def test_qwen3_predictor_reads_and_hit_rate():
    """Issue 34 on the Qwen3 trace, the default predictor at 10 % and 20 % of the experts:
    total reads (misses + reads ahead) within 1.2x cycle alone, and the hit rate at least
    OPT's demand rate at 10 % and 0.95x it at 20 % (70.99 % against 70.86 %, 82.31 %
    against 82.12 %: bench/README.md's predictor lab notes), well above cycle alone."""
    ev = parse(QWEN.read_text().splitlines())
    for slots in (614, 1229):
        alone = run(ev, "cycle", slots, predictor="none")
        on = run(ev, "cycle", slots, predictor=DEFAULT)
        opt = run(ev, "opt", slots)
        assert on.misses + on.prefetched <= 1.2 * alone.misses, (slots, on, alone)
        bound = opt.hit_rate if slots == 614 else 0.95 * opt.hit_rate
        assert on.hit_rate >= bound, (slots, on.hit_rate, opt.hit_rate)
        assert on.hit_rate >= alone.hit_rate + 0.04, (slots, on, alone)


TINY = "1 L0 n=1 1\n2 L1 n=1 2\n3 L0 n=1 1\n"
# k3d replay as a user runs it, with matplotlib made unimportable in that process only
NO_MATPLOTLIB = ("import sys; sys.modules['matplotlib'] = None; from k3d.commands.cli import main; "
                 "sys.exit(main(sys.argv[1:]))")


def _one_line_error(r, *words):
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("k3d replay: error: "), r.stderr
    assert all(w in r.stderr for w in words), r.stderr


def test_empty_trace_is_an_error(tmp_path):
    for text in ("", "5 c=1 t=0 begin\n"):
        trace = tmp_path / "t.trace"
        trace.write_text(text)
        _one_line_error(k3d("replay", str(trace), "--slots", "4"), "t.trace", "has no fetches")


def test_plot_problems_are_one_line_before_any_replay(tmp_path):
    trace = tmp_path / "t.trace"
    trace.write_text(TINY)
    r = subprocess.run([sys.executable, "-c", NO_MATPLOTLIB, "replay", str(trace), "--slots", "2",
                        "--plot", str(tmp_path / "c.png")], capture_output=True, text=True, timeout=60)
    _one_line_error(r, "--plot needs matplotlib", "pip install 'k3d-expert-cache[plot]'")
    missing = tmp_path / "no" / "such" / "c.png"
    _one_line_error(k3d("replay", str(trace), "--slots", "2", "--plot", str(missing)), f"no directory {missing.parent}")
    if os.geteuid() != 0:                # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        _one_line_error(k3d("replay", str(trace), "--slots", "2", "--plot", str(ro / "c.png")), f"cannot write in {ro}")
    assert not list(tmp_path.rglob("*.png"))


def _sub():
    import argparse
    return argparse.ArgumentParser().add_subparsers()


def test_sharing_table_labels_opt_the_bound_without_reads_ahead(capsys):
    assert k3d_main(["replay", SHARED, "--clients", "2", "--slots", "128"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines[2:5]] == ["cycle", "lru", "opt-demand"]
    assert lines[-1] == ("(opt-demand: Belady's OPT under the same pins on demand fetches alone, nothing read "
                         "ahead: the daemon's predictor, coact here, can pass it)")
