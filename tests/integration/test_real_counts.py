"""Integration: real key counts and real expert sizes, from sparse checkpoints.

DeepSeek-V3's shapes (58 MoE layers x 256 experts of 42 MiB FP8, ~650 GB) and
Kimi-K2's counts (60 MoE layers x 384), written by ``k3d.demo.sparse`` as
safetensors files whose data is a hole: the real ``k3d inspect`` and ``k3d
start`` read their headers like a shipped checkpoint's, a client fetches
experts (a few carry a pattern, the rest read as zeros) and ``k3ctl status``
answers.  The arena is small (a test must not take the machine's memory);
the start-up timings at a large arena are ``bench/real_counts.py``'s.
"""

import os
import shutil

import pytest

import k3client
from helpers import k3ctl, k3d
from k3d.demo.sparse import MARK, SHAPES, expert_bytes, write_sparse_checkpoint


def _apparent_and_disk(path):
    apparent = disk = 0
    for name in os.listdir(path):
        st = os.stat(os.path.join(path, name))
        apparent += st.st_size
        disk += st.st_blocks * 512
    return apparent, disk


@pytest.mark.parametrize("shape", ["deepseek-v3", "kimi-k2"])
def test_sparse_checkpoint_at_real_counts_is_served(tmp_path, start_daemon, shape):
    layers, experts, hidden, inter, dense, _ = SHAPES[shape]
    path = write_sparse_checkpoint(str(tmp_path / shape), shape, marked=((dense, 0), (layers - 1, experts - 1)))
    try:
        _serve(path, start_daemon, layers, experts, hidden, inter, dense)
    finally:
        shutil.rmtree(path)     # ~1 TB apparent: nobody's tools should meet it later


def _serve(path, start_daemon, layers, experts, hidden, inter, dense):
    moe_layers = layers - dense
    apparent, disk = _apparent_and_disk(path)
    assert apparent > moe_layers * experts * expert_bytes(hidden, inter)     # DeepSeek-V3: > 650 GB
    assert disk < 256 << 20, f"{disk} bytes on disk: the checkpoint is not sparse"

    r = k3d("inspect", path)
    assert r.returncode == 0, r.stderr
    assert f"{experts} per layer, {moe_layers * experts} in all; top-k 8" in r.stdout
    assert "format    fp8:E4M3" in r.stdout

    d = start_daemon(path, "--slots", 8, "--state-dir", "none", timeout=120)
    with k3client.connect(d.endpoint, name="real-counts") as c:
        assert c.slot_bytes >= expert_bytes(hidden, inter)
        c.begin_token()
        first, zero = c.fetch(dense, [0, 1])
        last, = c.fetch(layers - 1, [experts - 1])
        gate = first._spec("gate_proj.weight").offset
        assert bytes(first.memory()[gate:gate + len(MARK)]) == MARK
        assert bytes(last.memory()[gate:gate + len(MARK)]) == MARK
        assert bytes(zero.memory()[gate:gate + len(MARK)]) == bytes(len(MARK))
        c.begin_token()
        with pytest.raises(k3client.errors.UnknownExpert):
            c.fetch(dense - 1 if dense else layers, [0])       # a dense layer (or none) has no experts
        st = k3ctl("status", "--endpoint", d.endpoint)
        assert st.returncode == 0, st.stderr
        assert f"deepseek_v3 {moe_layers * experts} experts" in st.stdout
        assert c.status()["stats"]["misses"] == 3
    assert d.stop() == 0
