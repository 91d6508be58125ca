"""Sizes a person reads (k3d/sizes.py ``show_size``) parse back with ``parse_size``.

Property-based over every size from 0 to 4 PiB: the text is one shell word in a
binary unit the value reaches (so never ``0MiB`` for a size that is not zero),
reads back to within half a hundredth of its unit, and with ``up=True`` reads
back to at least the size (advice such as "raise --arena to at least X" suffices).
"""

import re

from hypothesis import given, strategies as st

from k3d.sizes import parse_size, show_size

SIZES = st.one_of(st.integers(0, 4 * 2**50), st.sampled_from([1023, 1024, 1025, 4096, 2**20 - 1, 2**20, 2**30 + 1]))
UNIT = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
SHAPE = re.compile(r"([0-9]+(?:\.[0-9]{1,2})?)(B|KiB|MiB|GiB|TiB)")


@given(SIZES)
def test_shown_size_parses_back_close(n):
    text = show_size(n)
    m = SHAPE.fullmatch(text)
    assert m, text
    assert float(m.group(1)) >= 1 or n == 0, text
    unit = UNIT[m.group(2)]
    assert n < 1024 or unit <= n and (n < 1024 * unit or unit == UNIT["TiB"])
    assert abs(parse_size(text) - n) <= unit / 200 + 1


@given(SIZES)
def test_shown_size_rounded_up_is_enough(n):
    text = show_size(n, up=True)
    assert SHAPE.fullmatch(text), text
    back = parse_size(text)
    assert n <= back <= n + UNIT[SHAPE.fullmatch(text).group(2)] / 100 + 1


def test_examples():
    assert [show_size(n) for n in (0, 512, 4096, 12 * 2**20 + 2**19, 2**30 + 2**28, 13 * 2**20 + 1)] == \
        ["0B", "512B", "4KiB", "12.5MiB", "1.25GiB", "13MiB"]
    assert show_size(13 * 2**20 + 1, up=True) == "13.01MiB"
    assert show_size(8 * 4096) == "32KiB" and show_size(2730 * 4096) == "10.66MiB"
