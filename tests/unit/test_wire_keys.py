"""``wire.keys``: a request's key list, checked in one pass when it is well formed, and
refused in one line naming the first bad key when it is not (the same refusals the
key-by-key check gives: the fast path never lets through what it would refuse)."""

import pytest

from k3client.errors import BadRequest, UnknownExpert
from k3d.serve import wire


class Keys:
    """What ``wire.keys`` asks of a source: its keys, and the words for an unknown one."""

    keys = {(l, e): () for l in range(3) for e in range(4)}

    def unknown(self, key):
        return f"unknown expert (layer {key[0]}, expert {key[1]})"


@pytest.mark.parametrize("raw", [[[0, 1], [2, 3]], [[1, 0]], []])
def test_well_formed_keys_come_back_as_tuples_in_order(raw):
    assert wire.keys({"keys": raw}, "keys", True, Keys()) == [tuple(k) for k in raw]


def test_predictions_may_repeat_a_key():
    assert wire.keys({"p": [[0, 1], [0, 1]]}, "p", False, Keys()) == [(0, 1), (0, 1)]


@pytest.mark.parametrize("raw,exc,words", [
    ([[0, 1], [0, 1]], BadRequest, "duplicate key (layer 0, expert 1)"),
    ([[0, 1], [True, 1]], BadRequest, "[True, 1] is not a [layer, expert] pair"),
    ([[0, 1.0]], BadRequest, "[0, 1.0] is not a [layer, expert] pair"),
    ([[0, 1, 2]], BadRequest, "[0, 1, 2] is not a [layer, expert] pair"),
    ([[[0], 1]], BadRequest, "[[0], 1] is not a [layer, expert] pair"),
    ([3], BadRequest, "3 is not a [layer, expert] pair"),
    # what msgpack decodes a bin or a map to unpacks into two ints: still not a pair
    ([b"\x00\x01"], BadRequest, "is not a [layer, expert] pair"),
    ([{0: 5, 1: 6}], BadRequest, "is not a [layer, expert] pair"),
    ([[0, 1], (1, 2)], BadRequest, "(1, 2) is not a [layer, expert] pair"),
    ([[0, 1], [3, 0]], UnknownExpert, "(layer 3, expert 0)"),
    ([[-1, 0]], UnknownExpert, "(layer -1, expert 0)"),
    ("nope", BadRequest, "keys must be a list"),
])
def test_a_bad_key_is_named_in_one_line(raw, exc, words):
    with pytest.raises(exc) as ei:
        wire.keys({"keys": raw}, "keys", True, Keys())
    assert words in str(ei.value) and "\n" not in str(ei.value)
