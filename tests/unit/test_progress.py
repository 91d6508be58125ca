"""Start-up progress (k3d/service/starting.py): the line, the ETA, terminal vs log output."""

import io

from k3d.service.starting import Progress, ProgressPrinter, describe


class Tty(io.StringIO):
    def isatty(self):
        return True


def steps(printer, phase, total, n):
    for i in range(1, n + 1):
        printer.show({"phase": phase, "done": total * i // n, "total": total, "eta_s": None})


def test_describe():
    p = {"phase": "pre-faulting the arena", "done": int(1.2 * 2**30), "total": 4 * 2**30, "eta_s": 8.2}
    assert describe(p) == "pre-faulting the arena 1.2/4.0 GiB (30 %), ~8 s left"
    assert describe({"phase": "opening the source", "done": 0, "total": 0, "eta_s": None}) == "opening the source"
    assert describe({"phase": "x", "done": 2**20, "total": 4 * 2**20, "eta_s": None}) == "x 1.0/4.0 MiB (25 %)"


def test_log_gets_a_line_per_tenth():
    out = io.StringIO()
    printer = ProgressPrinter(out)
    steps(printer, "collapsing the arena into huge pages", 64 * 2**30, 1024)
    steps(printer, "pre-faulting the arena", 64 * 2**30, 1024)
    lines = out.getvalue().splitlines()
    assert 20 <= len(lines) <= 22 and "\r" not in out.getvalue()
    assert lines[-1].endswith("(100 %)")


def test_terminal_redraws_one_line():
    out = Tty()
    printer = ProgressPrinter(out)
    steps(printer, "pre-faulting the arena", 2**30, 50)
    text = out.getvalue()
    assert text.count("\r\x1b[K") == 50 and text.count("\n") == 1 and text.endswith("(100 %)\n")


def test_eta_from_the_phase_so_far():
    p = Progress()
    p._last = p._phase_t0 = 0.0       # a phase that began at t=0 (monotonic clock), long ago
    first = p.update("pre-faulting the arena", 2**30, 4 * 2**30)
    assert first["eta_s"] is not None and first["eta_s"] > 0
    assert p.snapshot()["phase"] == "pre-faulting the arena"
    assert p.update("pre-faulting the arena", 4 * 2**30, 4 * 2**30)["eta_s"] == 0
