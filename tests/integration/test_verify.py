"""Checkpoints told apart by their bytes: a fine-tune of the served model is refused in one line.

Issue 32's reproduction: X and Y are tiny Qwen3-MoE checkpoints written by transformers
with one config and two seeds (Y is X's "fine-tune": same names, dtypes, shapes).  A real
``k3d start`` serves X; ``Client.verify`` and ``k3client.hf.load_model`` refuse Y in one
line naming both, accept X; status and ``k3ctl status`` show the digest; a restart takes it
from the state directory.
"""

from __future__ import annotations

import json
import os

import pytest
from hf_common import checkpoint, daemon_args

import k3client
from helpers import k3ctl, served_digest


@pytest.fixture(scope="module")
def pair():
    return checkpoint("qwen3_moe"), checkpoint("qwen3_moe", seed=1)


def _one_line_naming_both(msg: str, served: str, other: str) -> None:
    assert "\n" not in msg and served in msg and other in msg, msg
    assert "holds other bytes" in msg and "k3d start --source" in msg, msg


def test_fine_tune_is_refused_by_verify_and_load_model(pair, start_daemon, tmp_path):
    from k3client.hf import load_model

    served, other = pair
    d = start_daemon(served, *daemon_args("qwen3_moe"))
    with k3client.connect(d.endpoint, name="v") as c:
        digest = served_digest(c)
        assert c.verify(served)["hex"] == digest["hex"]
        with pytest.raises(k3client.Mismatch) as e:
            c.verify(other)
        _one_line_naming_both(str(e.value), served, other)
        assert digest["hex"][:12] in str(e.value)
        with pytest.raises(k3client.Mismatch, match="no such file"):
            c.verify(str(tmp_path / "nothing"))
        odd = tmp_path / "model.bin"                 # a format verify cannot read: said, never passed
        odd.write_bytes(b"pytorch pickle, say")
        with pytest.raises(k3client.Mismatch, match="cannot compare"):
            c.verify(str(odd))
    with pytest.raises(k3client.Mismatch) as e:
        load_model(other, endpoint=d.endpoint)
    _one_line_naming_both(str(e.value), served, other)


def test_status_shows_the_digest_and_a_restart_reads_it_from_the_state_dir(pair, start_daemon, tmp_path):
    served, _ = pair
    env = dict(os.environ, K3D_STATE_DIR=str(tmp_path / "state"))
    d = start_daemon(served, *daemon_args("qwen3_moe"), env=env)
    with k3client.connect(d.endpoint, name="wait") as c:
        served_digest(c)                       # computed after ready
    st = json.loads(k3ctl("status", "--json", "--endpoint", d.endpoint).stdout)
    first = st["model"]["digest"]
    assert not first["cached"] and first["bytes_read"] > 0
    text = k3ctl("status", "--endpoint", d.endpoint).stdout
    assert f"digest  {first['hex'][:16]}" in text, text
    assert f"digest {first['hex'][:16]} of {served}" in d.log()
    assert d.stop() == 0
    d = start_daemon(served, *daemon_args("qwen3_moe"), env=env)
    again = json.loads(k3ctl("status", "--json", "--endpoint", d.endpoint).stdout)["model"]["digest"]
    assert again["cached"] and again["bytes_read"] == 0 and again["hex"] == first["hex"]
    assert "from the state directory" in k3ctl("status", "--endpoint", d.endpoint).stdout
