"""Integration: a starting daemon is visible, and clients can wait for it.

The daemon runs under ``GATED_DAEMON``: the real CLI, held at its first
reservation step until the test creates a gate file, and saying in its log whom
its start-up responder answered.  So "still starting" and "a client was
already waiting" are states the test reaches on purpose, never races it may
lose: nothing here depends on how fast this machine reserves an arena.
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading

import pytest

import k3client
from helpers import held_launcher, poll_for, run_module

LINE = re.compile(r"^starting: (opening the source|sizing the arena|collapsing the arena into huge pages|"
                  r"reserving the arena)( [\d.]+/[\d.]+ (GiB|MiB) \(\d+ %\)(, ~\d+ s left)?)?$")

# ``k3d start`` held at its first reservation step (after that step's progress is published)
# until the file argv[1] exists; its start-up responder logs "gate: answered OP from NAME".
GATED_DAEMON = r"""
import os, sys, time
gate = sys.argv.pop(1)
from k3d.memory.arena import Arena
from k3d.service.starting import StartupResponder
from k3client.protocol import unpack

reserve = Arena._reserve
def held_reserve(self, progress, huge):
    def tick(done, total, seconds, what):
        progress(done, total, seconds, what)
        if not os.path.exists(gate):
            print("gate: holding at", what, done, "of", total, file=sys.stderr, flush=True)
            while not os.path.exists(gate):
                time.sleep(0.01)
    return reserve(self, tick, huge)
Arena._reserve = held_reserve

answer = StartupResponder._answer
def logged_answer(self, routing, frames):
    answer(self, routing, frames)
    try:
        msg = unpack(frames[0])
        print(f"gate: answered {msg.get('op')} from {msg.get('name')}", file=sys.stderr, flush=True)
    except Exception:
        pass
StartupResponder._answer = logged_answer

from k3d.commands.cli import main
sys.exit(main(sys.argv[1:]))
"""


def k3ctl(*args):
    """``k3ctl status ARGS``."""
    return run_module("k3d.commands.ctl", "status", *args, timeout=30)


def start_gated(start_daemon, checkpoint, tmp_path, **kw):
    """A gated daemon (a 1 GiB arena in plain pages: 16 reservation steps) and its gate file."""
    gate = tmp_path / "gate"
    d = start_daemon(checkpoint, "--arena", "1GiB", "--no-thp", wait_ready=False,
                     launcher=[sys.executable, "-c", GATED_DAEMON, str(gate)], **kw)
    return d, gate


def in_log(d, text):
    """``text`` is in the daemon's log (RuntimeError with the log if it exited)."""
    if text in d.log():
        return True
    if d.proc.poll() is not None:
        raise RuntimeError(f"daemon exited {d.proc.returncode}:\n{d.log()}")
    return False


def test_status_and_clients_while_starting(checkpoint, start_daemon, tmp_path):
    d, gate = start_gated(start_daemon, checkpoint, tmp_path)
    poll_for(lambda: in_log(d, "gate: holding at reserving"), 60, lambda: f"the gate:\n{d.log()}")

    r = k3ctl("--endpoint", d.endpoint)
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert LINE.match(r.stdout.strip()) and "reserving the arena" in r.stdout, r.stdout
    j = k3ctl("--endpoint", d.endpoint, "--json")
    assert j.returncode == 3
    st = json.loads(j.stdout)
    assert st["state"] == "starting" and st["pid"] == d.pid
    assert st["phase"] == "reserving the arena" and 0 < st["done"] < st["total"]
    with pytest.raises(k3client.Starting, match="is starting .*connect\\(wait=SECONDS\\)"):
        k3client.connect(d.endpoint, name="eager")

    got = {}

    def patient():        # waits until ready (its own client, on its own thread)
        try:
            with k3client.connect(d.endpoint, name="patient", wait=120) as c:
                got["ready_when_attached"] = "k3d: ready" in d.log()
                got["expert"] = c.fetch(0, [1])[0].expert
        except Exception as e:   # noqa: BLE001 -- reported by the asserts below
            got["error"] = repr(e)
    t = threading.Thread(target=patient)
    t.start()
    try:
        poll_for(lambda: in_log(d, "gate: answered hello from patient"), 60,
                 lambda: f"the patient client to be told 'starting':\n{d.log()}")
        assert "k3d: ready" not in d.log()
    finally:
        gate.touch()
        t.join(120)
    assert got == {"ready_when_attached": True, "expert": 1}, got
    assert k3ctl("--endpoint", d.endpoint).returncode == 0
    # not a terminal: one line per ~10 % per phase, not one per step
    lines = [line for line in d.log().splitlines() if "iB (" in line]
    assert 2 <= len(lines) <= 12, lines
    assert d.stop(signal.SIGTERM) == 0


def test_connect_wait_for_a_daemon_not_there_yet(checkpoint, start_daemon, tmp_path):
    endpoint = f"ipc://{tmp_path}/k.sock"
    waiter = subprocess.Popen([sys.executable, "-c", (
        "import sys, k3client\n"
        "try:\n"
        f"    k3client.connect({endpoint!r}, name='probe')\n"
        "except k3client.DaemonNotRunning:\n"
        "    print('absent', flush=True)\n"
        f"c = k3client.connect({endpoint!r}, name='waiter', wait=120)\n"
        "print(c.fetch(0, [2])[0].expert, flush=True)\n")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert waiter.stdout.readline().strip() == "absent"     # it found no daemon, then began to wait
        d, gate = start_gated(start_daemon, checkpoint, tmp_path, endpoint=endpoint)
        poll_for(lambda: in_log(d, "gate: answered hello from waiter"), 60,
                 lambda: f"the waiter to be told 'starting':\n{d.log()}")
        assert waiter.poll() is None                             # still waiting, not failed
        gate.touch()
        out, _ = waiter.communicate(timeout=120)
    finally:
        if waiter.poll() is None:
            waiter.kill()
            waiter.wait(10)
    assert waiter.returncode == 0 and out.strip() == "2"
    assert d.stop() == 0


def test_digest_after_ready_is_pending_and_verify_waits_for_it(checkpoint, start_daemon, tmp_path):
    """Ready does not wait for the content digest: it serves meanwhile, says the digest is
    pending, and a verify begun then waits for it and compares."""
    gate = tmp_path / "gate"
    # its content digest (computed after ready) holds until the file ``gate`` exists
    d = start_daemon(checkpoint, "--arena", "8MiB",
                     launcher=held_launcher("k3d.sources.digest", "AfterReady", gate, "digest"))
    poll_for(lambda: in_log(d, "gate: digest holding"), 30, d.log)
    with k3client.connect(d.endpoint, name="early") as c:
        assert c.model["digest"] == {"rule": "k3d-digest/1", "pending": True, "done": 0, "total": 64}
        assert c.fetch(0, [3])[0].expert == 3
        assert "digest  computing after ready: 0 of 64 experts" in k3ctl("--endpoint", d.endpoint).stdout
        got = {}

        def check():
            try:
                got["hex"] = c.verify(checkpoint)["hex"]
            except Exception as e:   # noqa: BLE001 -- reported by the asserts below
                got["error"] = repr(e)
        t = threading.Thread(target=check)
        t.start()
        t.join(0.5)
        assert t.is_alive() and not got         # the gate is shut: it can only be waiting
        gate.touch()
        t.join(60)
        served = c.status()["model"]["digest"]
    assert got == {"hex": served["hex"]}, got
    assert f"digest  {served['hex'][:16]}" in k3ctl("--endpoint", d.endpoint).stdout
    assert d.stop() == 0


def test_a_file_written_in_place_before_the_digest_is_never_verified(checkpoint, start_daemon, tmp_path):
    """A shard overwritten in place (``cp``: same inode) after ready but before the digest is
    computed: the daemon still serves the experts it read before, so a digest of the new bytes
    would let a client holding the new checkpoint verify and then compute with the old.
    The digest must say it cannot be computed (the source changed while served)."""
    import shutil

    import numpy as np

    from helpers import reference
    from k3d.demo.synthetic import write_checkpoint
    served = shutil.copytree(checkpoint, str(tmp_path / "served"))
    tuned = write_checkpoint(str(tmp_path / "tuned"), layers=4, experts=16, shards=2, seed=8)
    gate = tmp_path / "gate"
    d = start_daemon(served, "--arena", "8MiB",
                     launcher=held_launcher("k3d.sources.digest", "AfterReady", gate, "digest"))
    poll_for(lambda: in_log(d, "gate: digest holding"), 30, d.log)
    with k3client.connect(d.endpoint, name="early") as c:
        name = c.layout[0].name
        old = c.fetch(0, [1])[0].array(name).copy()            # resident from here on
        for f in os.listdir(tuned):
            if f.endswith(".safetensors"):
                with open(os.path.join(tuned, f), "rb") as src, open(os.path.join(served, f), "r+b") as dst:
                    shutil.copyfileobj(src, dst)                # in place: the same inode
        gate.touch()
        with pytest.raises(k3client.Mismatch, match="written since k3d opened it"):
            c.verify(tuned)
        c.begin_token()
        got = c.fetch(0, [1])[0].array(name)
        assert np.array_equal(got, old) and not np.array_equal(got, reference(tuned).expert(0, 1, name))
    d.stop()


# ``k3d start`` whose digest pool meets an error no source raises (a bug's ValueError).
BROKEN_DIGEST = r"""
import sys
from k3d.sources import digest
def broken(source, key, fds):
    raise ValueError("injected: not a source error")
digest._expert_hashes = broken
from k3d.commands.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_digest_that_fails_unexpectedly_is_not_pending_for_ever(checkpoint, start_daemon, tmp_path):
    """Whatever stops the digest after ready, it ends as an error a verify names at once, not as
    ``pending`` for ever (every loader would wait its whole timeout, then blame the daemon's pace)."""
    import shutil
    served = shutil.copytree(checkpoint, str(tmp_path / "served"))      # no cached digest
    d = start_daemon(served, "--arena", "8MiB", launcher=[sys.executable, "-c", BROKEN_DIGEST])
    with k3client.connect(d.endpoint, name="early", timeout=30) as c:
        with pytest.raises(k3client.Mismatch, match="cannot verify .*injected: not a source error"):
            c.verify(served)
        assert c.fetch(0, [3])[0].expert == 3                        # and it serves on
    assert d.stop() == 0
