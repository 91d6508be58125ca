"""``k3ctl status`` is a short-lived process: it loads neither numpy nor the client
(``k3client`` loads ``connect``, ``Client``, ``Expert`` and ``TensorSpec`` on first
use), nor argparse, logging or the daemon's modules, so the command costs little
beyond Python's own start and zmq (bench/README.md, "start-up at 16 GiB"); every
name ``k3client`` exports is still there.  The common command lines skip argparse
(``plain_status``); what they are given equals what argparse would give."""

import subprocess
import sys

from hypothesis import given, strategies as st

from helpers import ROOT
from k3d.commands import ctl

CODE = """
import sys, k3d.commands.ctl
heavy = [m for m in ("numpy", "k3client.client", "k3client.layout", "k3d.serve.access") if m in sys.modules]
import k3client
missing = [n for n in k3client.__all__ if getattr(k3client, n, None) is None]
print(heavy, missing, k3client.errors.K3Error.__name__)
"""

# What `k3ctl status` once loaded, or could load by a careless import: the client and numpy,
# the daemon's access checks and start-up (logging, sockets, threads), argparse.
HEAVY = {"numpy", "k3client.client", "k3client.layout", "k3d.serve.access", "k3d.service.starting",
         "k3d.service.daemon", "k3d.serve.loop", "logging", "socket", "argparse"}


def test_k3ctl_loads_no_numpy_and_k3client_still_has_every_name():
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0 and r.stdout.split() == ["[]", "[]", "K3Error"], (r.stdout, r.stderr)


def _imported(*argv) -> tuple[subprocess.CompletedProcess, set[str]]:
    """A real ``python -X importtime`` run of ``argv``, and the modules it imported."""
    r = subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True, text=True, cwd=ROOT,
                       timeout=60)
    names = {line.rsplit("|", 1)[1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    return r, names


def test_k3ctl_status_imports_nothing_heavy(tmp_path):
    """The whole command, to its answer (here: nothing listens), text and JSON."""
    _, floor = _imported("-c", "pass")          # what this Python's own start loads (site, .pth files)
    endpoint = f"ipc://{tmp_path}/k.sock"
    for extra in ([], ["--json"]):
        r, names = _imported("-m", "k3d.commands.ctl", "status", "--endpoint", endpoint, *extra)
        assert r.returncode == 1 and "k3d is not running at" in r.stdout + r.stderr, (r.stdout, r.stderr)
        assert {"zmq", "k3client.endpoint"} <= names     # importtime saw the command's imports
        assert (HEAVY - floor) & names == set(), extra


TOKENS = st.sampled_from(["status", "verify", "--json", "--endpoint", "--endpoint=ipc:///e/k.sock", "--endpoint=",
                          "ipc:///x/k.sock", "tcp://127.0.0.1:5555", "-x", "-1", "", "--jsn", "--end", "--",
                          "--timeout", "3", "--watch", "-h"])


@given(st.lists(TOKENS, max_size=6))
def test_plain_status_gives_what_argparse_gives(argv):
    """``plain_status`` takes a command line only where argparse takes it too, with the same
    result; anything else is left to argparse (its errors and help included)."""
    plain = ctl.plain_status(argv)
    if plain is None:
        return
    ap, sub, _, _ = ctl.parser()
    try:
        parsed = ctl.parse_args(ap, sub, argv)
    except SystemExit:                            # argparse refuses it: plain_status must not take it
        raise AssertionError(f"plain_status took {argv!r}, argparse refuses it") from None
    assert vars(plain) == vars(parsed)


def test_plain_status_takes_the_common_command_lines():
    assert vars(ctl.plain_status(["status"])) == {"cmd": "status", "endpoint": None, "json": False, "watch": None,
                                                  "timeout": ctl.STATUS_TIMEOUT}
    assert ctl.plain_status(["status", "--json", "--endpoint", "ipc:///e/k.sock"]).endpoint == "ipc:///e/k.sock"
    assert ctl.plain_status(["status", "--endpoint=tcp://h:1", "--json"]).json is True
    for other in (["status", "--watch"], ["status", "--timeout", "3"], ["status", "--jsn"], ["verify", "d"], []):
        assert ctl.plain_status(other) is None, other
