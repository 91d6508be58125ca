"""The daemon process's cyclic garbage collector, set once before the loop serves.

Why: the loop allocates a few short-lived containers per key it serves (plans,
loads, reports), so CPython's default thresholds (700, 10, 10) run a young
collection every ~60 fetches and a full one every few thousand, and a full one
walks everything the daemon built at start-up (the source's extents, per-key
tables at 15,000-60,000 keys): ~70 ms each on a 2-core EPYC VM, ~10 % of the
loop's CPU under ``bench/scale.py`` (measured with ``gc.callbacks``).

What: ``settle()`` collects once, then freezes what start-up built (``gc.freeze``:
moved to the permanent generation, never scanned again; it lives as long as the
daemon anyway) and raises the thresholds, so a young collection comes every
``YOUNG`` net allocations (~1,000 fetches; a pause of a few ms, where the default
paid ~0.3 ms every ~60 fetches) and a full one rarely.  The daemon makes few reference
cycles (none per request): what a collection would free is small, and the
thresholds only delay it.  Caller: ``k3d.service.daemon``, on the main thread,
after the server is built and before it serves; nothing else changes the GC.
"""

from __future__ import annotations

import gc

YOUNG = 5_000          # net container allocations between young collections (default 700)
MIDDLE = 20             # young collections per middle one (default 10)
OLD = 100               # middle collections per full one (default 10)


def settle() -> None:
    """Collect once, freeze start-up's objects, raise the thresholds (see the module docstring)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG, MIDDLE, OLD)
