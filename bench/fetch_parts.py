"""Where ``fetch_cpu.py``'s loop time goes, by part: wall time per fetch of named functions.

    python bench/fetch_parts.py [--parts MOD:QUALNAME,...] [fetch_cpu.py's options]

Runs ``bench/fetch_cpu.py`` as it is (same server, same requests, its own lines
printed) with a ``perf_counter_ns`` timer around each named function
(``module:function`` or ``module:Class.method``), and prints each part's
inclusive wall time per fetch over the measured reps (after ``--warm``), calls
per fetch, and its share of the request handler's time (``Server._handle``,
always timed: the total of the same run).  Parts nest: a part's time includes
the parts it calls.  Inside the loop every part costs two to three times what it
costs alone (the store, the policy and the predictor take the caches in
between), so this says where the time goes where it is paid.

A timer costs ~0.2 µs a call, more where parts nest: compare the figures of one
part list between two trees (alternating runs: ``cd`` into each tree with
``PYTHONPATH=$PWD``), not with ``fetch_cpu.py``'s own figure.  Wall time, not
CPU: run it on a quiet machine, and quote the load (AMD EPYC 2-core VM here).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fetch_cpu  # noqa: E402

HANDLER = "k3d.serve.loop:Server._handle"
PARTS = ",".join([
    "k3d.serve.wire:decode", "k3d.serve.ops:Ops._reports", "k3d.serve.wire:keys",
    "k3d.cache.fetch:FetchService.fetch", "k3d.cache.store:Store.fetch", "k3d.cache.fetch:FetchService.predict",
    "k3d.cache.store:Store.predict", "k3d.cache.fetch:FetchService._start", "k3d.cache.fetch:FetchService._auto",
    "k3d.cache.fetch:FetchService._note_pins", "k3d.cache.fetch:FetchService._finish_inline",
    "k3d.sources.identity:FileWatch.check", "k3d.cache.slots:SlotTable.complete_all",
    "k3d.cache.parked:Parked.answer", "k3d.serve.wire:Replies._send",
])


def timed(name: str, acc: dict) -> None:
    """Replace ``name`` (``module:qualname``) by a timer around it, adding to ``acc[name]``."""
    mod, qual = name.split(":")
    owner = importlib.import_module(mod)
    *path, attr = qual.split(".")
    for p in path:
        owner = getattr(owner, p)
    real = getattr(owner, attr)
    tally = acc[name] = [0, 0]                 # ns, calls
    clock = time.perf_counter_ns

    def timer(*args, **kw):
        t = clock()
        try:
            return real(*args, **kw)
        finally:
            tally[0] += clock() - t
            tally[1] += 1

    setattr(owner, attr, timer)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    ap.add_argument("--parts", default=PARTS, help="comma-separated MOD:QUALNAME (default: the miss path's)")
    a, rest = ap.parse_known_args()
    from k3d.compiled import status
    if status() != "interpreted":
        # compiled modules call each other directly, past these timers: the parts would
        # read zero, silently
        print(f"fetch_parts: k3d here is {status()}; it times Python calls, which a compiled module "
              "makes past its timers: run it with an editable install (pip install -e .)", file=sys.stderr)
        return 2
    acc: dict[str, list[int]] = {}
    for name in [HANDLER, *(p for p in a.parts.split(",") if p and p != HANDLER)]:
        timed(name, acc)
    # the first Driver.tokens call is the warm-up: the tallies start after it
    from k3d.cache.fetch import FetchService
    fetches, warm = [0], [True]
    real_tokens, real_fetch = fetch_cpu.Driver.tokens, FetchService.fetch

    def tokens(self, drawn, layers):
        n = real_tokens(self, drawn, layers)
        if warm[0]:
            warm[0] = False
            for tally in acc.values():
                tally[0] = tally[1] = 0
            fetches[0] = 0
        return n

    def fetch(self, *args, **kw):
        fetches[0] += 1
        return real_fetch(self, *args, **kw)

    fetch_cpu.Driver.tokens, FetchService.fetch = tokens, fetch
    sys.argv = [fetch_cpu.__file__, *rest]
    rc = fetch_cpu.main()
    n = max(1, fetches[0])
    total = acc[HANDLER][0] / n
    print(f"fetch_parts: wall time per fetch over {n} measured fetches (timers included); load "
          f"{os.getloadavg()[0]:.1f}")
    for name, (ns, calls) in acc.items():
        print(f"fetch_parts: {ns / n / 1e3:7.2f} us {ns / n / max(total, 1):6.1%} {calls / n:5.2f} calls  {name}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
