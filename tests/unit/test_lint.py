"""Tooling: ``ruff check`` (rules in pyproject.toml's [tool.ruff]) finds nothing in the project's code.

Runs the real ruff over the project's own trees (``TREES``), not whatever else lies in
the checkout: a virtual environment or build output there holds third-party code.
``ruff check .`` at the repository root, as a contributor types it, skips those too
(pyproject.toml's ``extend-exclude``).  ``ruff check --fix`` mends the import order and
most of what it finds.
"""

import importlib.util
import os
import shutil
import subprocess
import sys

from helpers import ROOT

TREES = ("k3d", "k3client", "tests", "bench", "examples", "docs")
FILES = ("setup.py",)          # the build's (the compiled request path: k3d/compiled.py)


def _ruff(cwd, *paths):
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", *paths],
                          cwd=cwd, capture_output=True, text=True, timeout=120)


def test_ruff_check_is_clean():
    assert importlib.util.find_spec("ruff"), "ruff is missing: pip install -e '.[test]' (it is in the test extra)"
    r = _ruff(ROOT, *TREES, *FILES)
    assert r.returncode == 0, f"ruff check found problems (run `ruff check --fix .`):\n{r.stdout}{r.stderr}"


def test_trees_hold_every_python_file_of_the_project():
    """A new top-level directory of code would otherwise go unlinted."""
    skip = {".git", "build", "dist"}
    for entry in os.scandir(ROOT):
        if not entry.is_dir() or entry.name in TREES or entry.name in skip or entry.name.startswith("."):
            continue
        if os.path.exists(os.path.join(entry.path, "pyvenv.cfg")) or entry.name.endswith(".egg-info"):
            continue
        found = [os.path.join(d, f) for d, _, fs in os.walk(entry.path) for f in fs if f.endswith(".py")]
        assert not found, f"{found[0]}: add its directory to TREES"
    assert not [f for f in os.listdir(ROOT) if f.endswith(".py") and f not in FILES]


def test_ruff_dot_skips_virtualenvs_in_the_checkout(tmp_path):
    """What `ruff check .` sees in a checkout holding a second venv: only the project's file."""
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), tmp_path)
    (tmp_path / "k3d").mkdir()
    (tmp_path / "k3d" / "ok.py").write_text('"""Clean."""\n')
    for venv in (".venv2", "venv-cpu"):
        lib = tmp_path / venv / "lib" / "python3.11" / "site-packages"
        lib.mkdir(parents=True)
        (lib / "third_party.py").write_text("import os\n")      # F401: ruff would flag it
    r = _ruff(tmp_path, ".")
    assert r.returncode == 0, r.stdout + r.stderr
    (tmp_path / "k3d" / "bad.py").write_text("import os\n")     # the project's own code is still linted
    assert "k3d/bad.py" in _ruff(tmp_path, ".").stdout


def test_test_modules_have_distinct_basenames():
    """tests/ has no __init__.py (pytest's rootdir import mode): two test files of one name in
    different layers make the whole run stop at collection ("import file mismatch")."""
    seen: dict[str, str] = {}
    for d, _, files in os.walk(os.path.join(ROOT, "tests")):
        for f in files:
            if f.startswith("test_") and f.endswith(".py"):
                path = os.path.relpath(os.path.join(d, f), ROOT)
                assert f not in seen, f"{path} and {seen[f]} share a basename: rename one"
                seen[f] = path
