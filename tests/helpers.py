"""Helpers every test layer shares: a CLI runner, ``poll_for``, and reference expert bytes.

``tests/`` is on ``sys.path`` (pytest's rootdir-relative conftest puts it there), so a
test in ``unit/``, ``component/`` or ``integration/`` writes ``from helpers import ...``.
A worker script started as a subprocess adds ``TESTS`` to its own path first.

- ``k3d(*args)`` / ``k3ctl(*args)`` run the real CLI (``python -m k3d`` or
  ``python -m k3d.commands.ctl``) in a subprocess and return the ``CompletedProcess`` with
  text stdout/stderr: what a user at a shell gets.
- ``poll_for(cond, timeout, what)`` waits for a condition instead of sleeping a fixed
  time: it returns the first truthy value of ``cond()`` and fails with ``what`` (a
  string, or a callable giving one, e.g. a daemon's log) when ``timeout`` passes first.
  An exception ``cond`` raises (a daemon that exited) ends the wait at once.
- ``lru_order(policy, slot_key)`` and ``policy_state(policy, slot_key)`` read a cache
  policy through the surface the store uses (``ranking``, ``export``): the recency order
  of an LRU policy, and a comparable picture of any policy's state.
- ``finished_loads`` and ``source_image`` serve component tests of the reader pool.
- ``reference(ckpt)`` reads a checkpoint's tensors with ``safetensors.safe_open``, the
  reference reader every served byte is compared with; ``expert_bytes`` assembles from
  it one expert's image as a slot holds it (tensors at their layout offsets), and
  ``verify`` compares fetched experts tensor by tensor, ``Reference.check`` an
expert image a source read into a buffer.

No state is shared between tests: each makes its own objects (a ``Reference`` is
read-only once built, so threads of one test may share it).
"""

from __future__ import annotations

import ast
import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from safetensors import safe_open

from k3d.config import DEFAULT_PATTERN

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


# -- the CLI, as a user runs it ------------------------------------------------------
def module_doc(module) -> str:
    """``module``'s docstring, read from its source: a module compiled by mypyc
    (``k3d.compiled``) has no ``__doc__``, and its ``.py`` lies beside the ``.so``."""
    path = module.__file__
    if not path.endswith(".py"):
        path = os.path.join(os.path.dirname(path), module.__name__.rpartition(".")[2] + ".py")
    with open(path) as f:
        return ast.get_docstring(ast.parse(f.read())) or ""


def run_module(module: str, *args, timeout: float = 60, cwd: str = ROOT, **kw) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS`` from the repository root (so it imports this tree), with captured
    text output; ``kw`` (``env``, ``input``, ...) goes to ``subprocess.run``."""
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, **kw)


def k3d(*args, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    """``k3d ARGS`` (``python -m k3d``)."""
    return run_module("k3d", *args, timeout=timeout, **kw)


def k3ctl(*args, timeout: float = 30, **kw) -> subprocess.CompletedProcess:
    """``k3ctl ARGS`` (``python -m k3d.commands.ctl``)."""
    return run_module("k3d.commands.ctl", *args, timeout=timeout, **kw)


def k3d_shm() -> set[str]:
    """Names in /dev/shm that k3d could have made (any would carry "k3d"): other test runs
    and programs on the machine add and remove their own there at any moment."""
    return {n for n in os.listdir("/dev/shm") if "k3d" in n.lower()}


# -- waiting for a condition ---------------------------------------------------------
def poll_for(cond: Callable[[], Any], timeout: float = 5.0, what: str | Callable[[], str] = "condition",
             interval: float = 0.01) -> Any:
    """Call ``cond()`` until it is truthy and return that value; AssertionError after ``timeout`` s.

    ``what`` names the condition in the failure message (a callable is called only then,
    so it may read a log).  The condition is checked once more at the deadline, so a slow
    machine that wakes late still sees the state it waited for."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() >= deadline:
            value = cond()
            if value:
                return value
            raise AssertionError(f"timed out after {timeout}s waiting for {what() if callable(what) else what}")
        time.sleep(interval)


def served_digest(client, timeout: float = 60.0) -> dict:
    """The daemon's content digest once computed (after ready it is ``pending`` a while:
    ``k3d.sources.digest.AfterReady``)."""
    def done():
        d = client.status()["model"].get("digest") or {}
        return None if d.get("pending") else d
    return poll_for(done, timeout, "the daemon's content digest", interval=0.05)


# -- a cache policy, through its public surface ---------------------------------------
def lru_order(policy, slot_key) -> list[int]:
    """An LRU policy's resident slots, least recently requested first (the next victim
    first, pins aside).  ``slot_key``: slot -> key, as ``Store.slot_key`` holds it."""
    slot_of = {k: s for s, k in enumerate(slot_key) if k is not None}
    return [slot_of[k] for k in reversed(policy.ranking(slot_key))]


def policy_state(policy, slot_key) -> tuple:
    """What a policy would do next, in comparable form: its ranking of the keys and the
    statistics it exports (equal before and after: the request changed nothing in it)."""
    return policy.ranking(slot_key), policy.export()


# -- reference bytes -----------------------------------------------------------------
class Reference:
    """A checkpoint's tensors as ``safetensors.safe_open`` reads them, loaded once (a test
    may rewrite or cut the files afterwards; the reference keeps the original bytes).

    ``tensors`` maps tensor name -> array; where the checkpoint has an index, its
    ``weight_map`` decides which shard a name comes from (a stale copy elsewhere is ignored)."""

    def __init__(self, ckpt, framework: str = "np"):
        ckpt = str(ckpt)
        index = os.path.join(ckpt, "model.safetensors.index.json")
        weight_map = None
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        self.tensors: dict[str, Any] = {}
        for path in sorted(glob.glob(os.path.join(ckpt, "*.safetensors"))):
            with safe_open(path, framework) as st:
                for name in st.keys():
                    if weight_map is None or weight_map.get(name) == os.path.basename(path):
                        self.tensors[name] = st.get_tensor(name)

    def __call__(self, name: str):
        return self.tensors[name]

    def expert(self, layer: int, expert: int, name: str, pattern: str = DEFAULT_PATTERN):
        """One tensor of expert (layer, expert): ``name`` is the layout's part, e.g. ``w1.weight_packed``."""
        return self.tensors[pattern.format(layer=layer, expert=expert, name=name)]

    def check(self, src, key: tuple[int, int], slot: bytes, pattern: str = DEFAULT_PATTERN) -> None:
        """``slot`` (an expert image read by source ``src``) holds every layout tensor at its offset."""
        for spec in src.layout:
            want = self.expert(*key, spec.name, pattern)
            got = np.frombuffer(slot, np.uint8, spec.nbytes, spec.offset)
            assert got.tobytes() == want.tobytes(), f"wrong bytes in {key} {spec.name}"


def reference(ckpt, framework: str = "np") -> Reference:
    """``ref(tensor_name)`` -> the tensor from the checkpoint's own shards, via safe_open."""
    return Reference(ckpt, framework)


def expert_bytes(ref: Reference, layout, key: tuple[int, int], pattern: str = DEFAULT_PATTERN) -> bytes:
    """Expert ``key``'s image as a slot holds it: every layout tensor at its offset, zeros between."""
    end = max((spec.offset + spec.nbytes for spec in layout), default=0)
    buf = bytearray(end)
    for spec in layout:
        data = np.ascontiguousarray(ref.expert(*key, spec.name, pattern)).tobytes()
        assert len(data) == spec.nbytes, (key, spec)
        buf[spec.offset:spec.offset + spec.nbytes] = data
    return bytes(buf)


def verify(client, experts, ref: Reference, pattern: str = DEFAULT_PATTERN) -> None:
    """Every tensor of every fetched expert equals the reference, byte for byte."""
    for ex in experts:
        for spec in client.layout:
            got, want = ex.array(spec.name), ref.expert(ex.layer, ex.expert, spec.name, pattern)
            assert got.shape == want.shape and got.tobytes() == want.tobytes(), (ex.layer, ex.expert, spec.name)


@contextlib.contextmanager
def moto_s3():
    """A real S3 API (moto's threaded server) on loopback, with the AWS_* environment boto3
    and the daemon read pointed at it for the duration; yields the env dict (for subprocesses)."""
    from moto import server as moto_server  # test extra; imported here so helpers load without it

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_CONFIG_FILE": "/dev/null", "AWS_SHARED_CREDENTIALS_FILE": "/dev/null"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


def finished_loads(loads, n: int, timeout: float = 10) -> list:
    """Poll a ``k3d.reads.loads.Loads``' reports until ``n`` loads have finished; returns them in
    finishing order (component tests of the reader pool)."""
    out, deadline = [], time.monotonic() + timeout
    while len(out) < n:
        assert time.monotonic() < deadline, f"{len(out)} of {n} loads finished"
        out.extend(load for _, load in loads.reported() if load is not None)
        time.sleep(0.005)
    return out


def source_image(src, key) -> bytes:
    """Expert ``key``'s image as the stock safetensors reader lays it in a slot (a subclass's
    faults or delays bypassed)."""
    from k3d.sources.safetensors import SafetensorsSource

    buf = bytearray(src.expert_bytes)
    SafetensorsSource.read(src, src.keys[key], memoryview(buf))
    return bytes(buf)


def held_launcher(module: str, cls: str, gate: str, what: str, prelude: str = "") -> list[str]:
    """A ``launcher`` for ``start_daemon``: ``k3d start`` whose ``module.cls._run`` (a background
    thread's work) first prints ``gate: <what> holding`` on stderr and waits until the file ``gate``
    exists; ``prelude`` runs before (e.g. to patch what start-up does)."""
    script = f"""
import os, sys, time
gate = sys.argv.pop(1)
from {module} import {cls}
{prelude}
run = {cls}._run
def held_run(self):
    print("gate: {what} holding", file=sys.stderr, flush=True)
    while not os.path.exists(gate):
        time.sleep(0.01)
    run(self)
{cls}._run = held_run
from k3d.commands.cli import main
sys.exit(main(sys.argv[1:]))
"""
    return [sys.executable, "-c", script, str(gate)]


def ctrl_c_reaches_it() -> None:
    """``preexec_fn``: SIGINT at its default in the child, as a terminal's foreground job
    has it, whatever the test run inherited.  A run started in the background by a
    non-interactive shell has SIGINT ignored, an ignored signal stays ignored across
    exec, and Python then installs no KeyboardInterrupt handler: the child would never
    see the Ctrl-C a test sends it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
