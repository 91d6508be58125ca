"""Byte sizes as people write them and read them.

``parse_size`` reads what a person types (``512MiB``, ``8GiB``, ``1.5G``, plain
bytes); ``show_size`` writes every size a person reads (start-up warnings,
``k3ctl status``, ``k3d inspect``, errors, CLI help) in a unit that shows it, and
``parse_size`` reads that text back (tests/unit/test_sizes.py checks the round
trip).  No imports beyond the standard library: ``k3ctl`` loads this and no more.
"""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_size(text) -> int:
    """``512MiB``, ``8GiB``, ``1.5G``, ``4096`` -> bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size (use e.g. 512MiB, 8GiB or plain bytes)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def show_size(n: int, up: bool = False) -> str:
    """Bytes for a person to read and paste back: ``512B``, ``12.5MiB``, ``1.25GiB``.

    The largest binary unit the size reaches, at most two decimals, no space (one
    shell word), never ``0`` of a unit for a size that is not zero.  ``parse_size``
    reads it back to within half a hundredth of the unit; with ``up`` the figure is
    rounded up instead, so that advice ("raise --arena to at least ...") is enough."""
    n = int(n)
    for unit, mult in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= mult:
            # hundredths of the unit in integers: a float would round 0.995 either way
            h = -(-n * 100 // mult) if up else (n * 100 + mult // 2) // mult
            return f"{h // 100}.{h % 100:02d}".rstrip("0").rstrip(".") + unit
    return f"{n}B"
