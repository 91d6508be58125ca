"""The vLLM plugin refuses in one line: daemon down (before any weight is read), another
checkpoint, a family it cannot compute.

Each case builds an in-process engine in a fresh Python (``run_engine_script``) and
reads the last line of its stderr, what a person running ``vllm serve`` sees last.
"""

import os

import pytest
from test_hf_load import _drop_cache, _resident_pages
from vllm_common import _vllm_ipc_files, checkpoint, run_engine_script  # noqa: F401 -- the autouse fixture

from conftest import SCRATCH, spawn_daemon

pytestmark = pytest.mark.vllm


def test_daemon_down_is_one_line_before_any_weight_is_read():
    path = checkpoint("qwen3_moe", split=True)
    shards = [os.path.join(path, n) for n in ("rest.safetensors", "experts.safetensors")]
    for s in shards:
        _drop_cache(s)
    ep = f"ipc://{SCRATCH}/vllm-none.sock"
    rc, last, err = run_engine_script(path, {"endpoint": ep})
    assert rc != 0
    assert "DaemonNotRunning" in last and ep in last, err[-3000:]
    for s in shards:
        assert _resident_pages(s, 0)[0] == 0, f"{s} was read before the daemon was asked"


def test_other_checkpoint_is_one_line_mismatch():
    served, other = checkpoint("qwen3_moe"), checkpoint("mixtral")
    d = spawn_daemon(served, "--arena", "8MiB")
    try:
        rc, last, err = run_engine_script(other, {"endpoint": d.endpoint})
    finally:
        d.stop()
    assert rc != 0
    assert "Mismatch" in last and served in last and other in last and "k3d start --source" in last, err[-3000:]


def test_family_it_cannot_compute_is_named():
    """gpt-oss (clamped SwiGLU, expert biases): refused while the model is built, naming the family."""
    path = checkpoint("gpt_oss")
    d = spawn_daemon(path, "--arena", "8MiB")
    try:
        rc, last, err = run_engine_script(path, {"endpoint": d.endpoint})
    finally:
        d.stop()
    assert rc != 0
    assert "FamilyError" in last and "gpt_oss" in last and "GptOssRoutedExperts" in last, err[-3000:]
    assert "Qwen3-MoE" in last                     # what it does compute
