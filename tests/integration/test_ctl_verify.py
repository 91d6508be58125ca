"""``k3ctl verify MODEL_DIR``: passes on the served model, names the expert on a fine-tune.

A real ``k3d start`` serves a tiny Mixtral written by ``save_pretrained``; ``k3ctl verify``
runs as a user runs it (a subprocess).  The fine-tune is a copy with the same config
and one expert's values changed (layer 1, expert 3, one tensor), written by the
safetensors library: verify must fail naming that layer and expert, not an earlier one.
A synthetic checkpoint (no config.json) is verified by bytes only; a daemon that is
down is "cannot verify", exit 2.
"""

from __future__ import annotations

import os
import shutil

import pytest
from hf_common import checkpoint, daemon_args, torch

from helpers import k3ctl
from k3d.demo.synthetic import write_checkpoint

FAMILY = "mixtral"


def fine_tune(src: str, dst: str, layer: int, expert: int) -> str:
    """``src`` with one tensor of expert (layer, expert) changed; everything else the same."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    name = f"model.layers.{layer}.block_sparse_moe.experts.{expert}.w2.weight"
    t = tensors[name].clone()
    t[0, 0] += 1
    tensors[name] = t
    save_file(tensors, path, metadata={"format": "pt"})
    return dst


def test_verify_passes_on_the_served_model_and_names_the_expert_of_a_fine_tune(tmp_path, start_daemon):
    path = checkpoint(FAMILY)
    d = start_daemon(path, *daemon_args(FAMILY, arena="1MiB"))
    r = k3ctl("verify", path, "--endpoint", d.endpoint, "--tokens", "5", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[-1].startswith(f"verified: {path} matches the daemon at {d.endpoint}"), r.stdout
    assert "logits equal over 5 tokens" in lines[-1], r.stdout
    assert "largest |daemon - checkpoint| difference 0 over 5 tokens (bfloat16)" in r.stdout

    tuned = fine_tune(path, str(tmp_path / "tuned"), layer=1, expert=3)
    r = k3ctl("verify", tuned, "--endpoint", d.endpoint, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("mismatch: layer 1, expert 3, tensor 'w2.weight': "), r.stdout
    assert "layer 0: 8 experts equal" in r.stdout          # layer 0 was compared and agrees
    assert "logits" not in r.stdout                         # never computed with wrong bytes
    assert d.proc.poll() is None
    assert d.stop() == 0


def test_verify_by_bytes_alone_and_when_the_daemon_is_down(tmp_path, start_daemon):
    a = write_checkpoint(str(tmp_path / "a"), layers=2, experts=4, hidden=128, inter=64, seed=1)
    b = write_checkpoint(str(tmp_path / "b"), layers=2, experts=4, hidden=128, inter=64, seed=2)
    d = start_daemon(a, "--pin-quota", "2")               # verify fetches fewer at a time
    r = k3ctl("verify", a, "--endpoint", d.endpoint)
    assert r.returncode == 0 and "logits not compared" in r.stdout, r.stdout + r.stderr
    r = k3ctl("verify", b, "--endpoint", d.endpoint)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.strip().splitlines()[-1].startswith("mismatch: layer 0, expert 0, tensor "), r.stdout
    assert d.stop() == 0
    r = k3ctl("verify", a, "--endpoint", d.endpoint, "--timeout", "1")
    assert r.returncode == 2 and r.stdout.startswith("cannot verify: "), r.stdout + r.stderr
    assert len(r.stdout.strip().splitlines()) == 1


def test_verify_refuses_bad_arguments():
    r = k3ctl("verify", "/nonexistent-k3d-model", "--tokens", "0")
    assert r.returncode == 2 and "--tokens 0" in r.stderr


@pytest.fixture(autouse=True)
def _torch():
    assert torch is not None
