"""Faults: the daemon restarts mid-generate (same output), a client is killed (others unaffected)."""

import json
import os
import signal
import subprocess
import sys

import pytest
from hf_common import checkpoint, daemon_args, eager, torch

from helpers import poll_for


def test_daemon_restart_mid_forward_is_transparent(start_daemon):
    from k3client.hf import load_model

    path = checkpoint("qwen2_moe")
    d = start_daemon(path, *daemon_args("qwen2_moe"))
    ref = eager(path)
    model = load_model(path, endpoint=d.endpoint, dtype=torch.bfloat16)
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(3))
    want = ref.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    calls, restarted = [0], []

    def restart_between_layers(mod, args):
        calls[0] += 1
        if calls[0] == 4 and not restarted:   # the 4th forward, after layer 0 fetched (pins held)
            assert d.stop() == 0
            restarted.append(start_daemon(path, *daemon_args("qwen2_moe"), endpoint=d.endpoint))

    hook = model.model.layers[1].register_forward_pre_hook(restart_between_layers)
    try:
        got = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert restarted and model.k3d.client.restarts == 1
        assert torch.equal(want, got)
        assert restarted[0].proc.poll() is None
    finally:
        hook.remove()
        model.k3d.client.close()


def _worker(path, endpoint, seed, tokens):
    cmd = [sys.executable, "-m", "k3d.demo.hf", "worker", path, "--endpoint", endpoint,
           "--tokens", str(tokens), "--seed", str(seed)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_killed_client_leaves_others_unaffected(start_daemon):
    """A worker process and this process generate on one small arena; the worker is SIGKILLed
    mid-generate; this process finishes with eager's tokens and the daemon drops the dead pins."""
    import k3client
    from k3client.hf import load_model

    path = checkpoint("qwen3_moe")
    d = start_daemon(path, *daemon_args("qwen3_moe", arena="256KiB"))   # small: pins matter
    victim = _worker(path, d.endpoint, 0, 400)
    ref = eager(path)
    model = load_model(path, endpoint=d.endpoint, dtype=torch.bfloat16)
    for line in victim.stdout:                 # it is generating (holding pins) from here on
        if json.loads(line).get("step", 0) >= 2:
            break
    steps = [0]

    def kill_at_third_forward(mod, args):
        steps[0] += 1
        if steps[0] == 3:
            victim.send_signal(signal.SIGKILL)

    hook = model.model.register_forward_pre_hook(kill_at_third_forward)
    try:
        ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(5))
        want = ref.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
        got = model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert victim.wait(60) == -signal.SIGKILL
        assert torch.equal(want, got)
    finally:
        hook.remove()
        model.k3d.client.close()
    with k3client.connect(d.endpoint) as c:
        poll_for(lambda: not any(cl["pid"] == victim.pid for cl in c.status()["clients"]), 30,
                 lambda: f"the killed client to be reaped: {c.status()['clients']}", interval=0.1)
    assert d.proc.poll() is None and os.path.exists(d.endpoint[len("ipc://"):])


def test_daemon_back_on_a_fine_tune_refuses_the_next_forward(start_daemon, tmp_path):
    """The daemon restarts on another checkpoint of the same shapes (a fine-tune): the model,
    verified at load against the first, refuses its next forward in one line instead of
    computing with the other's experts after a transparent re-attach (the client compares the
    digest its verify waited for with the new daemon's)."""
    import k3client
    from k3client.hf import load_model
    from k3d.demo import hf_models

    path = checkpoint("qwen2_moe")
    tuned = hf_models.write("qwen2_moe", str(tmp_path / "tuned"), seed=1)
    d = start_daemon(path, *daemon_args("qwen2_moe"))
    model = load_model(path, endpoint=d.endpoint, dtype=torch.bfloat16)
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(3))
    try:
        model(ids)
        assert d.stop() == 0
        start_daemon(tuned, *daemon_args("qwen2_moe"), endpoint=d.endpoint)
        with pytest.raises(k3client.DaemonRestarted, match="came back serving another checkpoint"):
            model(ids)
        with pytest.raises(k3client.DaemonRestarted, match="came back serving another checkpoint"):
            model(ids)                                      # and again: never attached to it
        assert model.k3d.client.restarts == 0
    finally:
        model.k3d.client.close()
