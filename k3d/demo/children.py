"""The demos' child processes (the daemon, the model processes): how they start and stop.

``PYTHON`` starts each one: ``-P`` keeps the current directory off its import path,
where a folder named ``k3d`` (a clone's parent holds one) would shadow this
installation, as ``python -m k3d`` alone lets it.

``Children`` (a context manager, in the demo's main thread) starts them in process
groups of their own, so a Ctrl-C at the terminal reaches the demo alone and not
each child with a traceback of its own; whatever ends the ``with`` block (a return,
Ctrl-C, an error) then stops the children still running, the last started first
(the model processes before the daemon they use), with SIGINT ignored meanwhile so
a second Ctrl-C cannot cut that short.  Inside the block SIGTERM and SIGHUP (not
ignored by whoever started the demo, as ``nohup`` does) raise ``Stopped``, a
``KeyboardInterrupt``, so they end the demo the same way instead of killing it
with its children left running.  The caller prints the one line and exits
``128 + signum``.
"""

from __future__ import annotations

import signal
import subprocess
import sys

PYTHON = (sys.executable, "-P")
STOP_WAIT_S = 30     # a child that outlives SIGTERM this long is killed


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived: the demo stops as on Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum, frame):
    raise Stopped(signum)


class Children:
    def __init__(self):
        self.procs: list[subprocess.Popen] = []
        self._saved: dict[int, object] = {}

    def start(self, cmd: list[str], **kw) -> subprocess.Popen:
        p = subprocess.Popen(cmd, process_group=0, **kw)
        self.procs.append(p)
        return p

    def __enter__(self) -> Children:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) == signal.SIG_DFL:
                self._saved[sig] = signal.signal(sig, _raise_stopped)
        return self

    def __exit__(self, *exc) -> None:
        sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            live = [p for p in reversed(self.procs) if p.poll() is None]
            for p in live:
                p.terminate()
            for p in live:
                try:
                    p.wait(STOP_WAIT_S)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        finally:
            signal.signal(signal.SIGINT, sigint)
            for sig, handler in self._saved.items():
                signal.signal(sig, handler)


def interrupted(prog: str, e: KeyboardInterrupt) -> int:
    """The one line for a demo ended by Ctrl-C (or ``Stopped``), and its exit status."""
    signum = getattr(e, "signum", signal.SIGINT)
    print(f"{prog}: stopped by {signal.Signals(signum).name}; its daemon and model processes are stopped "
          "and its files removed", file=sys.stderr)
    return 128 + signum
