"""Integration: examples/vllm_serve.md says what the project does, and its daemon runs as written.

Its install lines are the README's (``broken_deps --remove``, not a hand-written
``pip uninstall``), every test it cites exists, and its ``k3d start`` line, run on the
model its own ``python -c`` line writes, starts a daemon without a warning (an arena
that fits the model, not the default's 414 MiB never used).
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "vllm_serve.md"


def test_vllm_serve_example_installs_as_the_readme_does_and_cites_tests_that_exist():
    text = EXAMPLE.read_text()
    assert "pip uninstall" not in text
    assert "python -m k3client.vllm.broken_deps --remove" in text
    cited = re.findall(r"(tests/[\w/]+\.py)::(\w+)", text)
    assert cited
    for path, name in cited:
        assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), f"{path}::{name} does not exist"


def test_vllm_serve_example_daemon_starts_without_a_warning(tmp_path, start_daemon):
    pytest.importorskip("torch")
    pytest.importorskip("transformers", minversion="5")
    text = EXAMPLE.read_text()
    model = str(tmp_path / "tiny-qwen3")
    write = re.search(r'^python -c "(from k3d\.demo import vllm_models;[^"]+)"$', text, re.M).group(1)
    subprocess.run([sys.executable, "-c", write.replace("/tmp/tiny-qwen3", model)], check=True, timeout=600)
    argv = re.search(r"^k3d start (.+) &$", text, re.M).group(1).split()
    args = [a for i, a in enumerate(argv)      # the example's own options; this test's model and endpoint
            if a not in ("--source", "--endpoint") and argv[i - 1] not in ("--source", "--endpoint")]
    assert "--arena" in args
    d = start_daemon(model, *args)
    assert "WARNING" not in d.log(), d.log()
    assert d.stop() == 0
