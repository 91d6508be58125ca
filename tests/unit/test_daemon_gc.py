"""Unit: the daemon's collector settings (``k3d.service.collector``), in a child process
so that this test process keeps its own."""

import subprocess
import sys

from helpers import ROOT

PROBE = r"""
import gc
from k3d.service import collector
before = gc.get_freeze_count()
kept = [[i] for i in range(1000)]          # start-up's objects: tracked containers
collector.settle()
print(gc.get_threshold() == (collector.YOUNG, collector.MIDDLE, collector.OLD),
      gc.get_freeze_count() >= before + len(kept), gc.get_count()[0] < 100)
"""


def test_settle_freezes_start_up_objects_and_raises_the_thresholds():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "True"]
