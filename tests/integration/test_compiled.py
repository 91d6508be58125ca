"""Integration: the compiled request path (``k3d.compiled``, ``setup.py``), built as
``pip install .`` builds it, and the project's own tests run against it.

The suite itself runs on an editable install, which never compiles; so this is where
the compiled modules are tested.  mypyc checks their annotations at run time, and a
compiled class takes no new attribute: a fault of either kind shows up only here.

- One wheel is built per session (``K3D_COMPILE=1``: a failure to compile fails the
  test, no fallback; no build isolation: mypy comes from the test extra).
- The tests run from a copy of the checkout without ``k3d``/``k3client``, with the
  unpacked wheel on ``PYTHONPATH``, so the test process and every daemon it starts
  import the compiled build; ``K3D_EXPECT_COMPILED`` makes ``conftest`` refuse to run
  on interpreted modules, in the test process and in every daemon it starts (their
  ready line names the build).  The unit and component layers run, and the
  integration tests of the trust guarantees.
- Replays of the bundled trace give the same JSON compiled and interpreted.
- A compiler that fails gives a wheel with every module interpreted (never a mix).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

from helpers import ROOT
from k3d.compiled import MODULES

SOURCE = ("k3d", "k3client", "setup.py", "pyproject.toml", "README.md")
# what runs against the build: the unit and component layers (a real server loop), ~2.5
# min, and the integration tests of the trust guarantees (`k3d start` subprocesses and
# client processes that time out, die, hold views, fuzz the wire, outlive a restart),
# ~1 min; the docs, lint and packaging tests read the checkout's files, not the build
UNIT_SKIP = ("test_docs_site.py", "test_lint.py", "test_packaging.py")
INTEGRATION = ("test_trust.py", "test_trust_views.py", "test_trust_liveness.py", "test_faults.py",
               "test_fuzz_protocol.py", "test_hit_path_stress.py", "test_multiprocess.py", "test_restart.py")
EXT = sysconfig.get_config_var("EXT_SUFFIX")


def _have_compiler() -> bool:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc) is not None and importlib.util.find_spec("mypyc") is not None


def source_copy(tmp):
    """This checkout's source (what a wheel is built from), copied under ``tmp``."""
    src = tmp / "src"
    src.mkdir()
    for name in SOURCE:
        path = os.path.join(ROOT, name)
        if os.path.isdir(path):
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        else:
            shutil.copy(path, src / name)
    return src


def build_wheel(src, tmp, env_extra: dict) -> tuple[str, subprocess.CompletedProcess]:
    """A wheel built from ``src`` (its ``build/`` kept from any earlier build there, as
    setuptools keeps it), unpacked under ``tmp``; returns (its directory, the build)."""
    out, lib = tmp / "wheel", tmp / "lib"
    # setuptools' build backend, called as pip calls it without build isolation (mypy from
    # the test extra, nothing downloaded); not pip itself, which runs `rustc --version`
    # for its user agent, and a rustup proxy then writes ~/.rustup
    hook = "import sys; from setuptools import build_meta; build_meta.build_wheel(sys.argv[1])"
    r = subprocess.run([sys.executable, "-c", hook, str(out)], cwd=src, capture_output=True, text=True,
                       env={**os.environ, **env_extra}, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(lib)
    return str(lib), r


def run_in(lib: str, code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(lib), env={**os.environ, "PYTHONPATH": lib})
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@pytest.fixture(scope="module")
def compiled_build(tmp_path_factory):
    """(the unpacked compiled wheel, the source it was built in)."""
    if not _have_compiler():
        pytest.skip("no C compiler or no mypyc here: a regular install is interpreted (test_a_failing_compiler...)")
    tmp = tmp_path_factory.mktemp("compiled")
    src = source_copy(tmp)
    lib, _ = build_wheel(src, tmp, {"K3D_COMPILE": "1"})
    return lib, src


@pytest.fixture(scope="module")
def compiled(compiled_build):
    return compiled_build[0]


def test_the_wheel_holds_every_module_compiled(compiled):
    for m in MODULES:
        path = os.path.join(compiled, *m.split("."))
        assert os.path.exists(path + EXT), f"{m}: no extension module in the wheel"
        assert os.path.exists(path + ".py"), f"{m}: the source is not in the wheel beside it"
    assert run_in(compiled, "from k3d.compiled import status; print(status())") == \
        f"compiled ({len(MODULES)} modules, mypyc)"


def test_the_projects_tests_pass_against_the_compiled_build(compiled, tmp_path):
    tree = tmp_path / "tree"                  # the checkout without the source: imports go to the build
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(
        ".git", "k3d", "k3client", "build", "dist", "*.egg-info", ".venv*", "venv*", "__pycache__", "site",
        ".pytest_cache", ".hypothesis", ".ruff_cache", ".mypy_cache", ".benchmarks"))
    unit = [str(p) for p in sorted((tree / "tests" / "unit").glob("test_*.py")) if p.name not in UNIT_SKIP]
    component = str(tree / "tests" / "component")
    integration = [str(tree / "tests" / "integration" / name) for name in INTEGRATION]
    env = {**os.environ, "PYTHONPATH": compiled, "K3D_EXPECT_COMPILED": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                        *unit, component, *integration],
                       cwd=tree, capture_output=True, text=True, env=env, timeout=1500)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " passed" in r.stdout.splitlines()[-1]


@pytest.mark.parametrize("args", [("--slots", "80,128", "--policy", "cycle"),
                                  ("--slots", "80,128", "--policy", "lru", "--predictor", "none"),
                                  ("--slots", "128", "--policy", "cycle", "--clients", "2")])
def test_replays_are_the_same_compiled_and_interpreted(compiled, args):
    trace = os.path.join(ROOT, "traces", "mixtral8x7b-gsm8k.trace")
    # each run says which build it imported, then replays (the same process)
    code = ("import sys; from k3d.compiled import status; print(status(), flush=True); "
            "from k3d.commands.cli import main; sys.exit(main())")
    cmd = [sys.executable, "-c", code, "replay", trace, "--json", *args]
    got = {}
    for name, path in (("compiled", compiled), ("interpreted", ROOT)):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=os.path.dirname(compiled),
                           env={**os.environ, "PYTHONPATH": path})
        assert r.returncode == 0, r.stderr
        build, _, got[name] = r.stdout.partition("\n")
        assert build.startswith(name), (name, build)
    assert got["compiled"] == got["interpreted"]


def test_a_failing_compiler_installs_everything_interpreted(tmp_path, request):
    """No module compiled rather than some: a compiled module calls the others directly.
    Built where the compiled wheel was, when there is one: setuptools keeps that build's
    extension modules in ``build/``, and none of them may come along."""
    if importlib.util.find_spec("mypyc") is None:
        pytest.skip("no mypyc here: the build does not try")
    src = request.getfixturevalue("compiled_build")[1] if _have_compiler() else source_copy(tmp_path)
    # an edit since that build: mypyc writes new C, so the compiler runs (and fails); an
    # unchanged source would reuse the earlier build's modules, of the same source
    edited = src / "k3d" / "cache" / "policy" / "lru.py"
    edited.write_text(edited.read_text() + "\n_EDITED_SINCE = 1\n")
    lib, r = build_wheel(src, tmp_path, {"CC": "false", "K3D_COMPILE": "auto"})
    assert "k3d build: the C compiler failed" in r.stdout + r.stderr
    assert not [f for _, _, fs in os.walk(lib) for f in fs if f.endswith(EXT)]
    assert run_in(lib, "from k3d.compiled import status; print(status())") == "interpreted"


def test_an_editable_install_compiles_nothing():
    """This suite runs on an editable install (the README's test command): a ``.so`` in
    the checkout would shadow the developer's edits."""
    spec = importlib.util.spec_from_file_location("k3d_setup", os.path.join(ROOT, "setup.py"))
    setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup)             # (not __main__: it does not run setup())
    assert not setup.compiles(["editable_wheel", "--dist-dir", "x"], "auto")
    assert not setup.compiles(["develop"], "auto")
    assert not setup.compiles(["build_ext", "--inplace"], "auto")      # .so files into the checkout
    assert not setup.compiles(["egg_info"], "auto")
    assert not setup.compiles(["sdist", "--dist-dir", "build"], "auto")  # (an option's value is no command)
    assert not setup.compiles(["bdist_wheel"], "0")
    assert setup.compiles(["bdist_wheel", "--dist-dir", "x"], "auto")
    if os.path.dirname(importlib.util.find_spec("k3d").origin) == os.path.join(ROOT, "k3d"):
        assert not [f for d, _, fs in os.walk(os.path.join(ROOT, "k3d")) for f in fs if f.endswith(EXT)]
