"""The session's leftover check (tests/leftovers.py), run on small pytest sessions of its own.

Each case is a real ``python -m pytest`` subprocess whose conftest loads the plugin
as tests/conftest.py does: a test that leaves a file in ``$HOME`` or ``$TMPDIR``, or
a ``/dev/shm`` name carrying the session's marker, fails that session, naming the
file; a session that cleans up passes even while another process (this test,
standing in for a concurrent run) has unmarked files in ``/dev/shm`` and ``/tmp``.
Every scratch directory is gone afterwards, whatever the verdict.
"""

import glob
import os
import subprocess
import sys
import tempfile

import pytest

from helpers import TESTS

CONFTEST = "from leftovers import pytest_configure, pytest_sessionfinish  # noqa: F401\n"


def _session(tmp_path, body):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_case.py").write_text(body)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    before = set(glob.glob("/tmp/k3t-*"))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    mine = [d for d in set(glob.glob("/tmp/k3t-*")) - before if not os.path.exists(os.path.join(d, "work"))]
    assert not mine, f"the session's scratch directory was not removed: {mine}"
    return r


@pytest.mark.parametrize("where, path", [
    ("home", "os.path.expanduser('~/.local/state/k3d/state-x.json')"),
    ("tmp", "os.path.join(tempfile.mkdtemp(prefix='k3d-hf-tests-'), 'model.safetensors')"),
    ("shm", "'/dev/shm/k3d-' + os.environ['K3D_TEST_MARKER']"),
])
def test_a_file_left_behind_fails_the_session_and_is_named(tmp_path, where, path):
    r = _session(tmp_path, f"""
import os, tempfile
def test_leaves():
    p = {path}
    os.makedirs(os.path.dirname(p), exist_ok=True)
    open(p, "w").close()
    print("LEFT", p)
""")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "1 passed" in r.stdout and "the test session left 1 file(s) behind" in r.stdout, r.stdout
    top = {"home": "/home/.local", "tmp": "/tmp/k3d-hf-tests-", "shm": "/dev/shm/k3d-k3t-"}[where]
    assert top in r.stdout, r.stdout
    assert not [n for n in os.listdir("/dev/shm") if "k3t-" in n and n.startswith("k3d-")]


def test_a_clean_session_passes_beside_another_process_files(tmp_path):
    theirs = [tempfile.mkstemp(prefix="k3d-other-run-", dir=d)[1] for d in ("/dev/shm", "/tmp")]
    try:
        r = _session(tmp_path, """
import os, tempfile
def test_cleans_up(tmp_path):
    (tmp_path / "kept-by-pytest").write_text("x")      # pytest's own tmp_path: not a leftover
    fd, p = tempfile.mkstemp()
    os.close(fd)
    os.unlink(p)
    assert os.environ["HOME"].endswith("/home") and os.environ["TMPDIR"].endswith("/tmp")
""")
        assert r.returncode == 0, r.stdout + r.stderr
        assert "left" not in r.stdout
        assert all(os.path.exists(p) for p in theirs)
    finally:
        for p in theirs:
            os.unlink(p)
