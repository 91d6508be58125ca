"""``k3ctl status`` is a short-lived process: it loads neither numpy nor the client
(``k3client`` loads ``connect``, ``Client``, ``Expert`` and ``TensorSpec`` on first
use), so the command costs little beyond Python's own start (bench/README.md,
"start-up at 16 GiB"); every name ``k3client`` exports is still there."""

import subprocess
import sys

from helpers import ROOT

CODE = """
import sys, k3d.commands.ctl
heavy = [m for m in ("numpy", "k3client.client", "k3client.layout", "k3d.serve.access") if m in sys.modules]
import k3client
missing = [n for n in k3client.__all__ if getattr(k3client, n, None) is None]
print(heavy, missing, k3client.errors.K3Error.__name__)
"""


def test_k3ctl_loads_no_numpy_and_k3client_still_has_every_name():
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0 and r.stdout.split() == ["[]", "[]", "K3Error"], (r.stdout, r.stderr)
