"""Integration: ``k3d demo`` as a new user first runs it: from any folder, and stopped with Ctrl-C.

The demo is started as the installed ``k3d`` script starts it: ``python -P -m k3d``
(the script's own folder, not the current one, heads its import path), in a real
subprocess, with real daemon and model processes under it.
"""

import os
import re
import signal
import subprocess
import sys

import psutil
import pytest

import k3client
from helpers import ctrl_c_reaches_it, k3d_shm, poll_for

K3D = [sys.executable, "-P", "-m", "k3d"]


def _decoy(folder) -> None:
    """A ``k3d/`` folder in the current directory, as the parent of a clone holds one.

    An empty one shadows an editable install for ``python -m k3d`` started there (a
    namespace package, found before the install's finder); this one is a package of its
    own, so that it shadows any installation (PYTHONPATH included) and says so."""
    (folder / "k3d").mkdir()
    (folder / "k3d" / "__init__.py").write_text(
        "raise ImportError('imported the k3d/ folder of the current directory, not k3d')\n")


def test_demo_runs_from_a_folder_holding_a_k3d_directory(tmp_path):
    _decoy(tmp_path)
    r = subprocess.run([*K3D, "demo", "--tokens", "5", "--clients", "2"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "demo: OK" in r.stdout and "Traceback" not in r.stderr


def test_hf_demo_runs_from_a_folder_holding_a_k3d_directory_and_says_what_its_rates_include(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers", minversion="5")
    _decoy(tmp_path)
    r = subprocess.run([*K3D, "demo", "--hf", "--clients", "1", "--tokens", "2"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600, check=False)
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.returncode == 0 and "same tokens with and without k3d: True" in r.stdout, r.stdout + r.stderr[-2000:]
    # each tokens/s says, in its own line, what it includes
    k3d_line, eager_line = (next(ln for ln in r.stdout.splitlines() if ln.startswith(f"  {kind} "))
                            for kind in ("k3d  ", "eager"))
    assert re.search(r"tok/s \(\d+% of its time in \d+ round trips to the daemon, [\d.]+ ms each, "
                     r"in a toy model of [\d.]+ MiB experts\)", k3d_line), k3d_line
    assert "tok/s (experts in its own memory: no round trips)" in eager_line


def _fetches(endpoint: str) -> int:
    try:
        with k3client.connect(endpoint, name="ctrl-c-test") as c:
            st = c.status()["stats"]
    except Exception:       # the daemon is not serving yet
        return 0
    return st["hits"] + st["misses"]


def test_ctrl_c_during_the_demo_is_one_line_and_exit_130():
    """SIGINT to the demo's process group, as the terminal sends it on Ctrl-C, while its model
    processes are fetching: one line on stderr, no traceback, exit 130, and every child
    process, file and shared-memory entry gone."""
    shm_before = k3d_shm()
    demo = subprocess.Popen([*K3D, "demo", "--tokens", "100000", "--clients", "3"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=ctrl_c_reaches_it)
    try:
        first = demo.stdout.readline()
        assert first.startswith("demo: checkpoint "), first + demo.stderr.read()
        ckpt = first.split()[2].rstrip(":")
        tmp = os.path.dirname(ckpt)
        poll_for(lambda: _fetches(f"ipc://{tmp}/k3d.sock") > 0, timeout=120, what="the model processes' fetches")
        children = poll_for(lambda: len(kids := psutil.Process(demo.pid).children(recursive=True)) == 4 and kids,
                            timeout=60, what="the daemon and 3 model processes")
        os.killpg(demo.pid, signal.SIGINT)
        out, err = demo.communicate(timeout=120)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()
    assert demo.returncode == 130, err
    assert "Traceback" not in out + err
    assert err.count("\n") == 1 and err.startswith("k3d demo: stopped by SIGINT"), err
    assert not os.path.exists(tmp)
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, alive
    assert k3d_shm() - shm_before == set()
