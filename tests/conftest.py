"""Shared fixtures: a synthetic checkpoint and a real ``k3d start`` subprocess.

``start_daemon(source, *args)`` runs the real CLI (``python -m k3d start``)
on a private ipc endpoint under tmp_path, waits for its ``ready`` line and
returns a ``Daemon`` handle; every daemon still running at the end of a test is
stopped with SIGTERM (and its exit code checked by the tests that care).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

from helpers import poll_for
from k3d.compiled import status as build_status
from k3d.demo.synthetic import write_checkpoint

# tests/integration/test_compiled.py runs tests against a compiled build it made:
# that run must not pass on the interpreted modules by mistake (a path order).
if os.environ.get("K3D_EXPECT_COMPILED") and not build_status().startswith("compiled"):
    raise RuntimeError(f"K3D_EXPECT_COMPILED is set, but this run imports k3d {build_status()}")

# HOME, XDG_*, TMPDIR of this session (and of every subprocess) point into its own
# scratch directory (set on import, before any test runs), checked for leftovers
# when the session ends.
from leftovers import ROOT, pytest_configure, pytest_sessionfinish  # noqa: F401  (hooks)

# Every socket directory and daemon log of this test session lives under one
# short directory (ipc paths must fit sun_path's 108 bytes), removed with the
# session's scratch directory.  0755 so that the other-user permission tests can
# reach the sockets inside.
SCRATCH = os.path.join(ROOT, "work")
os.makedirs(SCRATCH, mode=0o755)
os.chmod(SCRATCH, 0o755)


class Daemon:
    def __init__(self, proc, endpoint, log_path):
        self.proc, self.endpoint, self.log_path = proc, endpoint, log_path

    @property
    def pid(self):
        return self.proc.pid

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def ready(self) -> bool:
        """The daemon printed its ready line; RuntimeError (with the log) if it exited instead."""
        if "k3d: ready" in self.log():
            return True
        if self.proc.poll() is not None:
            raise RuntimeError(f"daemon exited {self.proc.returncode}:\n{self.log()}")
        return False

    def stop(self, sig=15, timeout=30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def spawn_daemon(source, *args, endpoint=None, env=None, wait_ready=True, timeout=60, launcher=None):
    """Start ``k3d start`` on a fresh endpoint; returns a Daemon once it says ready.

    ``launcher`` replaces ``python -m k3d`` (argv before ``start``), e.g. a
    script that wraps the real CLI with slowed-down reads."""
    if endpoint is None:
        endpoint = f"ipc://{tempfile.mkdtemp(prefix='t-', dir=SCRATCH)}/k.sock"
    # Each daemon keeps its warm-restart state apart (a test that restarts one passes
    # --state-dir, which wins): no daemon warms from another test's statistics.
    env = dict(os.environ if env is None else env)
    env.setdefault("K3D_STATE_DIR", tempfile.mkdtemp(prefix="state-", dir=SCRATCH))
    log_path = tempfile.mktemp(prefix="log-", dir=SCRATCH)
    cmd = [*(launcher or [sys.executable, "-m", "k3d"]), "start", "--endpoint", endpoint]
    if source is not None:
        cmd += ["--source", str(source)]
    cmd += [str(a) for a in args]
    with open(log_path, "w") as logf:        # the daemon writes its own copy of the descriptor
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env)
    d = Daemon(proc, endpoint, log_path)
    if wait_ready:
        try:
            poll_for(d.ready, timeout, lambda: f"the daemon's ready line:\n{d.log()}", interval=0.02)
        except AssertionError:
            proc.kill()
            raise
        if os.environ.get("K3D_EXPECT_COMPILED") and "build=compiled" not in d.log():
            proc.kill()
            raise RuntimeError(f"K3D_EXPECT_COMPILED is set, but this daemon is not compiled:\n{d.log()}")
    return d


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """4 layers x 16 experts, two shards plus index.json (~13 MB)."""
    return write_checkpoint(str(tmp_path_factory.mktemp("ckpt")), layers=4, experts=16, shards=2, seed=7)


@pytest.fixture
def start_daemon():
    started = []

    def start(source, *args, **kw):
        d = spawn_daemon(source, *args, **kw)
        started.append(d)
        return d

    yield start
    for d in started:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait(10)
