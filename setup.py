"""The compiled request path (k3d/compiled.py says what and why); everything else is in
pyproject.toml.

A wheel build compiles ``k3d.compiled.MODULES`` with mypyc when it can, and installs
them all interpreted when it cannot (no mypyc, no C compiler, a module that fails);
an editable install never compiles.  ``K3D_COMPILE=0``: never; ``K3D_COMPILE=1``: a
failure is an error, not a fallback (the test that builds it sets this).
"""

import ast
import os
import sys
import sysconfig
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
MODE = os.environ.get("K3D_COMPILE", "auto")       # auto | 0 | 1
# only a command that builds extensions runs mypyc (a metadata query or an sdist would
# spend its time for nothing); an editable install, or a build into the checkout itself
# (--inplace), never compiles: a .so beside a .py shadows the developer's edits
BUILDS = {"bdist_wheel", "build", "build_ext", "install"}
NEVER = {"editable_wheel", "develop", "sdist", "egg_info", "dist_info", "--inplace", "-i"}
EXT = sysconfig.get_config_var("EXT_SUFFIX") or ".so"


def _say(msg: str) -> None:
    print(f"k3d build: {msg}", file=sys.stderr)


def _modules() -> list[str]:
    """``MODULES`` from k3d/compiled.py, read without importing k3d (not installed yet)."""
    tree = ast.parse((HERE / "k3d" / "compiled.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MODULES" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise RuntimeError("k3d/compiled.py has no MODULES")


def _fail(why: str, mode: str = MODE) -> list:
    if mode == "1":
        raise SystemExit(f"k3d build: K3D_COMPILE=1 and {why}")
    _say(f"{why}; the request path is installed interpreted (k3ctl status says which)")
    return []


def compiles(argv: list[str], mode: str) -> bool:
    """Whether this setup command compiles: a build of extensions, nothing that writes into
    the checkout or only describes the project, and not turned off.  (Command names and
    flags only: an option's value never names one of these.)"""
    words = {a for a in argv if a in BUILDS or a in NEVER}
    return mode != "0" and not words & NEVER and bool(words & BUILDS)


def _ext_modules(argv: list[str], mode: str) -> list:
    if not compiles(argv, mode):
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        return _fail("mypyc is not installed", mode)
    paths = [m.replace(".", "/") + ".py" for m in _modules()]
    try:
        # asserts kept: they are the store's and the policy's invariants
        return mypycify(paths, opt_level="3", debug_level="0", strip_asserts=False, group_name="k3d")
    except (Exception, SystemExit) as e:          # mypyc exits on a type error
        return _fail(f"mypyc could not compile the request path ({e})", mode)


class BuildExt(build_ext):
    """All the compiled modules or none.  setuptools keeps its build directory between
    builds of one checkout, and installs whatever lies there: so every extension module
    of k3d in it that this build does not make goes first (a module no longer compiled
    would load before its .py), and a compile failure removes all of them."""

    def _ours(self) -> list[str]:
        root = Path(self.build_lib)
        return [str(p) for p in (*root.glob(f"k3d/**/*{EXT}"), *root.glob(f"k3d__mypyc*{EXT}"))]

    def run(self) -> None:
        current = {self.get_ext_fullpath(ext.name) for ext in self.extensions}
        for path in self._ours():
            if path not in current:
                os.remove(path)
        try:
            super().run()
        except Exception as e:                    # CCompilerError, CompileError, OSError (no cc)
            if MODE == "1":
                raise
            for path in self._ours():
                os.remove(path)
            self.extensions = []
            _fail(f"the C compiler failed ({e})")


if __name__ == "__main__":                        # (setuptools' build backend runs it so)
    setup(ext_modules=_ext_modules(sys.argv[1:], MODE), cmdclass={"build_ext": BuildExt})
