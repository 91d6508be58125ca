"""pytest plugin: a test session writes only into scratch directories of its own, and leaves them empty.

On import (conftest loads it before any test module, so every daemon, CLI and
worker subprocess inherits it), one fresh directory ``/tmp/k3t-XXXXXXXX`` (0755,
so the other-user tests can reach sockets below it) gets a subdirectory for each
place a process writes by default, and the environment points there:

    HOME             home/      (~/.local/state/k3d, ~/.config, ...)
    XDG_STATE_HOME   state/     (the daemons' warm-restart files)
    XDG_RUNTIME_DIR  run/       (0700; the default endpoint's socket directory)
    TMPDIR           tmp/       (tempfile, hence mkdtemp without dir=)
    XDG_CACHE_HOME   cache/     (third-party caches: matplotlib's font list, ...)
    MPLCONFIGDIR, TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR   below cache/

``K3D_TEST_MARKER`` carries the directory's name, for names made outside it
(``/dev/shm``).  pytest's own ``tmp_path`` directories go under ``pytest/``
(``--basetemp`` given on the command line wins); ``session_dir(prefix)`` is a
directory under ``shared/`` for data a whole session's tests share (checkpoints
written once, read by many).

When the session ends, anything still in home/, state/, run/ or tmp/, and any
``/dev/shm`` entry whose name contains the marker, fails the run with the paths
named; then the whole directory is removed (cache/, pytest/, shared/ and the
conftest's work/ are removed unchecked: their owners are the session itself).  The
check looks only at what this session owns, so test runs of other checkouts on
the same machine, at the same time, neither trip it nor are tripped by it.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

ROOT = tempfile.mkdtemp(prefix="k3t-", dir="/tmp")      # short: ipc socket paths below it fit sun_path
os.chmod(ROOT, 0o755)
MARKER = os.path.basename(ROOT)
CHECKED = {"HOME": "home", "XDG_STATE_HOME": "state", "XDG_RUNTIME_DIR": "run", "TMPDIR": "tmp"}
UNCHECKED = {"XDG_CACHE_HOME": "cache", "MPLCONFIGDIR": os.path.join("cache", "matplotlib"),
             "TORCHINDUCTOR_CACHE_DIR": os.path.join("cache", "torchinductor"),
             "TRITON_CACHE_DIR": os.path.join("cache", "triton")}
SHM = "/dev/shm"

for _var, _sub in {**CHECKED, **UNCHECKED}.items():
    os.makedirs(os.path.join(ROOT, _sub), mode=0o700 if _var == "XDG_RUNTIME_DIR" else 0o755, exist_ok=True)
    os.environ[_var] = os.path.join(ROOT, _sub)
os.environ["K3D_TEST_MARKER"] = MARKER
tempfile.tempdir = None                                # gettempdir() reads TMPDIR again


def session_dir(prefix: str) -> str:
    """A fresh directory that lives as long as the test session (removed with it)."""
    os.makedirs(os.path.join(ROOT, "shared"), exist_ok=True)
    return tempfile.mkdtemp(prefix=prefix, dir=os.path.join(ROOT, "shared"))


def leftovers() -> list[str]:
    """What this session left: entries in its checked directories and marked /dev/shm names."""
    left = []
    for sub in CHECKED.values():
        d = os.path.join(ROOT, sub)
        left += sorted(os.path.join(d, name) for name in os.listdir(d))
    if os.path.isdir(SHM):
        left += sorted(os.path.join(SHM, name) for name in os.listdir(SHM) if MARKER in name)
    return left


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    if not config.option.basetemp:
        config.option.basetemp = os.path.join(ROOT, "pytest")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    left = leftovers()
    if left:
        shown = "\n  ".join(left[:20]) + (f"\n  ... and {len(left) - 20} more" if len(left) > 20 else "")
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = f"the test session left {len(left)} file(s) behind:\n  {shown}"
        if reporter is not None:
            reporter.write_sep("=", "leftovers", red=True)
            reporter.write_line(message)
        else:
            print(message)
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    for path in left:
        if path.startswith(SHM + "/"):
            os.unlink(path)
    shutil.rmtree(ROOT, ignore_errors=True)
