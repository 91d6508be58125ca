"""Tooling: ``ruff check`` (rules in pyproject.toml's [tool.ruff]) finds nothing in the repository.

Runs the real ruff over the whole tree, as ``ruff check .`` at the repository root
does, and fails with ruff's own report.  ``ruff check --fix`` mends the import
order and most of what it finds.
"""

import importlib.util
import subprocess
import sys

from helpers import ROOT


def test_ruff_check_is_clean():
    assert importlib.util.find_spec("ruff"), "ruff is missing: pip install -e '.[test]' (it is in the test extra)"
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"ruff check found problems (run `ruff check --fix .`):\n{r.stdout}{r.stderr}"
