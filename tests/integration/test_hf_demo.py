"""examples/hf_generate.py: N processes share one daemon; the routed experts count once (PSS)."""

import json
import os
import re
import subprocess
import sys

import hf_common  # noqa: F401  (skips without torch/transformers)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_processes_share_the_experts_pss_measured_in_the_same_run():
    n = 2
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "hf_generate.py"), "--clients", str(n),
                        "--tokens", "6", "--hidden", "256", "--inter", "1024", "--json"],
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode in (0, 1), r.stderr[-3000:]
    assert "Writing model shards" not in r.stdout + r.stderr       # transformers' bar stays out of the output
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert rep["same_tokens"], "k3d and plain processes generated different tokens"
    assert len(rep["k3d"]) == len(rep["eager"]) == n
    # the figures the example prints exist and are sane
    assert 0 <= rep["hit_rate"] <= 1 and 0 <= rep["prediction_precision"] <= 1
    assert all(w["tok_s"] > 0 and w["pss"] > 0 for w in rep["k3d"] + rep["eager"])
    # the mission: the experts' bytes count once on the host
    assert rep["pss_sum_eager"] - rep["pss_sum_k3d"] >= (n - 1) * rep["expert_bytes"], rep
    assert rep["ok"] and r.returncode == 0


def test_k3d_demo_hf_flag_is_wired():
    r = subprocess.run([sys.executable, "-m", "k3d", "demo", "--help"], capture_output=True, text=True,
                       check=False)
    assert r.returncode == 0 and "--hf" in r.stdout


def test_example_help_describes_every_option():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "hf_generate.py"), "--help"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    options = re.split(r"\n(?=  -)", r.stdout.split("options:", 1)[1].rstrip())
    for option in filter(str.strip, options):
        first, *rest = option.strip("\n").splitlines()
        described = re.split(r"\s{2,}", first.strip(), maxsplit=1)[1:] + rest      # beside it, or below it
        assert " ".join(described).strip(), f"no description: {first.strip()}"
    assert len(options) >= 7
    assert "model processes of each kind" in r.stdout and "one JSON line" in r.stdout
