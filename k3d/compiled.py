"""The request path compiled: which modules a regular install compiles, and whether
this process runs them so.

Why: the daemon's loop thread spends most of a fetch in Python steps (the policy's
victims, the store's plan, the index's words, the wire), and a fine-grained model
makes 58+ fetches per token per client.  mypyc compiles these modules, the same
source, into C extension modules; ``bench/fetch_cpu.py`` measures the difference
(docs/benchmarks.md).  mypyc rather than a hand-written extension: the source stays
the one the tests read, and the interpreted modules remain the fallback.

The build (``setup.py``):
- ``pip install .`` (or a wheel) compiles ``MODULES`` when mypyc (a build requirement)
  and a C compiler are there.  Where either is missing, or any module fails to
  compile, it installs them all interpreted and says so: a compiled module calls the
  other compiled ones directly, so a mixed build is never installed.
- An editable install (``pip install -e .``) never compiles: a ``.so`` beside a
  ``.py`` would shadow the developer's edits.
- ``K3D_COMPILE=0`` in the environment turns it off; ``K3D_COMPILE=1`` makes a
  failure to compile an error rather than a fallback.

What compiling asks of these modules (the caller's obligations, kept by
``tests/integration/test_compiled.py``, which builds the wheel and runs the store,
policy and request-path tests against it):
- Their annotations are checked at run time: a value of another type than the one
  declared is a ``TypeError``, where the interpreter would have gone on.  So they
  declare only what holds for every caller (``Any`` where a field starts as None).
- A compiled class takes no subclass from interpreted code, and its instances take
  no attribute it does not declare (no monkeypatching a method on an instance).
- Every ``__init__`` says ``-> None`` (mypy checks an unannotated function's body
  as untyped, and mypyc then types its ``self`` as ``object``).

``status()`` is what ``k3ctl status`` and the benches print.
"""

from __future__ import annotations

from functools import cache
from importlib.util import find_spec

# Kept in import order: setup.py reads this tuple (ast), it does not import k3d.
MODULES = (
    "k3d.cache.policy.base",
    "k3d.cache.policy.usage",
    "k3d.cache.policy.filing",
    "k3d.cache.policy.order",
    "k3d.cache.policy.cycle",
    "k3d.cache.policy.lru",
    "k3d.cache.policy.opt",
    "k3d.cache.predictions",
    "k3d.cache.slots",
    "k3d.cache.store",
    "k3d.cache.parked",
    "k3d.cache.fetch",
    "k3d.reads.inline",
    "k3d.reads.loads",
    "k3d.memory.index",
    "k3d.serve.wire",
)


def is_compiled(module: str) -> bool:
    """Whether ``module`` would load from an extension module (found, not imported)."""
    spec = find_spec(module)
    return spec is not None and (spec.origin or "").endswith((".so", ".pyd"))


@cache
def status() -> str:
    """``compiled (16 modules, mypyc)``, ``interpreted``, or which are which if mixed
    (found once: what a process imports does not change under it)."""
    done = [m for m in MODULES if is_compiled(m)]
    if not done:
        return "interpreted"
    if len(done) == len(MODULES):
        return f"compiled ({len(done)} modules, mypyc)"
    return f"mixed: compiled {', '.join(done)}; the rest interpreted"
