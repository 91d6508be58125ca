"""Integration: a starting daemon is visible (issue 14, start-up you can see)."""

import json
import re
import signal
import subprocess
import sys
import time

import pytest

import k3client
from helpers import poll_for, run_module

LINE = re.compile(r"^starting: (opening the source|sizing the arena|collapsing the arena into huge pages|"
                  r"pre-faulting the arena)( [\d.]+/[\d.]+ (GiB|MiB) \(\d+ %\)(, ~\d+ s left)?)?$")


def k3ctl(*args):
    """``k3ctl status ARGS``."""
    return run_module("k3d.commands.ctl", "status", *args, timeout=30)


def wait_for(pred, what, timeout=60):
    poll_for(pred, timeout, what, interval=0.02)


def test_status_and_clients_while_starting(checkpoint, start_daemon):
    d = start_daemon(checkpoint, "--arena", "2GiB", wait_ready=False)
    r = None

    def answered_starting():
        nonlocal r
        r = k3ctl("--endpoint", d.endpoint)
        assert d.proc.poll() is None, d.log()
        return r.returncode == 3 or "k3d: ready" in d.log()

    wait_for(answered_starting, "no starting status")
    if r.returncode != 3:
        pytest.skip("the 2 GiB arena was ready before k3ctl could ask")
    assert LINE.match(r.stdout.strip()), r.stdout
    j = k3ctl("--endpoint", d.endpoint, "--json")
    if j.returncode == 3:
        st = json.loads(j.stdout)
        assert st["state"] == "starting" and st["pid"] == d.pid and "phase" in st
        with pytest.raises(k3client.Starting, match="is starting .*connect\\(wait=SECONDS\\)"):
            k3client.connect(d.endpoint, name="eager")
    with k3client.connect(d.endpoint, name="patient", wait=120) as c:   # waits until ready
        assert "k3d: ready" in d.log()
        assert c.fetch(0, [1])[0].expert == 1
    assert k3ctl("--endpoint", d.endpoint).returncode == 0
    # not a terminal: one line per ~10 % per phase, not one per chunk
    lines = [line for line in d.log().splitlines() if "GiB (" in line]
    assert 2 <= len(lines) <= 2 * 12, lines
    assert d.stop(signal.SIGTERM) == 0


def test_connect_wait_for_a_daemon_not_there_yet(checkpoint, start_daemon, tmp_path):
    endpoint = f"ipc://{tmp_path}/k.sock"
    with pytest.raises(k3client.DaemonNotRunning):
        k3client.connect(endpoint, name="early")
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-c", (
        "import sys, k3client\n"
        f"c = k3client.connect({endpoint!r}, name='waiter', wait=120)\n"
        "print(c.fetch(0, [2])[0].expert)\n")], stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)            # the waiter is already waiting (nothing to observe: no daemon yet)
    d = start_daemon(checkpoint, "--arena", "4MiB", endpoint=endpoint)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0 and out.strip() == "2"
    assert time.monotonic() - t0 >= 0.5
    assert d.stop() == 0
