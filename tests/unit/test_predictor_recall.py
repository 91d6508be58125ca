"""Recall (k3d.cache.predict.recall): past passes that took the same path vote for the next layer.

- the closest past pass decides (a sharp power of the overlap), a pass in progress
  or one whose client left never votes, the ring keeps the last ``window`` passes
  only, and its memory stays within the stated bound in layers x experts;
- through ``CoPredictor`` on a stream where a layer's pick depends on the two
  layers before together (pairs alone say 50/50): with recall the proposals are
  right, without it (the naive-Bayes counts alone) they are a coin toss.
"""

import random

from k3d.cache.predict import CoPredictor
from k3d.cache.predict.recall import BYTES, MIN_WINDOW, WINDOW, Recall, window_for

E = 32


def rows_of(parts, experts=E):
    """CoPredictor's context rows: (d - 1) * E + a for expert a of the layer d before."""
    return [(d - 1) * experts + a for d, picks in parts for a in picks]


def one_pass(r, client, route):
    r.begin(client)
    for m, picks in enumerate(route):
        r.learn(client, m, picks)
    r.end(client)


def test_the_closest_past_pass_decides():
    r = Recall(4, E, depth=2, temper=0.7, window=8)
    one_pass(r, 1, [(0, 1), (2, 3), (4, 5), (12, 13)])      # path A
    one_pass(r, 1, [(0, 1), (6, 7), (8, 9), (12, 13)])      # path B: the same first layer
    # this pass: layer 0 as both, layer 1 as B
    v = r.votes(2, rows_of([(1, (6, 7)), (2, (0, 1))]))
    assert v[8] > 0.99 and v[9] > 0.99
    assert v[4] < 0.01 and v[5] < 0.01 and v[10] == 0.0
    v = r.votes(2, rows_of([(1, (2, 3)), (2, (0, 1))]))
    assert v[4] > 0.99 and v[8] < 0.01
    assert r.votes(2, rows_of([(1, (20, 21))])) is None      # nothing overlaps: no opinion


def test_a_pass_in_progress_or_left_never_votes():
    r = Recall(3, E, depth=2, temper=0.7, window=4)
    r.begin(1)
    r.learn(1, 0, (0, 1))
    r.learn(1, 1, (2, 3))
    assert r.votes(1, rows_of([(1, (0, 1))])) is None        # not finished: not kept yet
    r.forget(1)
    r.end(1)                                                 # (nothing left to end)
    assert not r.x.any()
    one_pass(r, 2, [(0, 1), (2, 3), (4, 5)])
    r.begin(3)                                               # another client's pass, unfinished
    r.learn(3, 0, (0, 1))
    r.learn(3, 1, (6, 7))
    v = r.votes(1, rows_of([(1, (0, 1))]))
    assert v[2] > 0.99 and v[6] == 0.0


def test_the_ring_keeps_the_last_window_passes():
    r = Recall(2, E, depth=1, temper=0.7, window=2)
    one_pass(r, 1, [(0, 1), (2, 3)])
    one_pass(r, 1, [(4, 5), (6, 7)])
    one_pass(r, 1, [(8, 9), (10, 11)])                       # takes the first pass's column
    assert r.votes(1, rows_of([(1, (0, 1))])) is None        # the first pass is gone ...
    assert int(r.x.sum()) == 8                               # ... every key it set cleared
    assert r.votes(1, rows_of([(1, (8, 9))]))[10] > 0.99
    assert r.x.shape == (2 * E, 2)


def test_memory_is_bounded_in_layers_by_experts():
    for L, experts in [(2, 24), (48, 128), (58, 256), (61, 384), (200, 1024)]:
        w = window_for(L, experts)
        assert MIN_WINDOW <= w <= WINDOW
        assert Recall(L, experts, 1, 0.7).nbytes() == 4 * w * L * experts <= max(BYTES, 4 * MIN_WINDOW * L * experts)


def xor_token(rng) -> list[list[int]]:
    """Layer 0 picks pair a, layer 1 pair b (each one of two, at random); layer 2's pair
    is a xor b: each of layers 0 and 1 alone says nothing of it."""
    a, b = rng.randrange(2), rng.randrange(2)
    return [[2 * a, 2 * a + 1], [4 + 2 * b, 5 + 2 * b], [8 + 2 * (a ^ b), 9 + 2 * (a ^ b)]]


def precision_on_xor(with_recall: bool) -> tuple[int, int]:
    rng = random.Random(5)
    p = CoPredictor(3, E)
    if not with_recall:
        p.recall = None
    right = proposed = 0
    for t in range(400):
        route = xor_token(rng)
        for layer, picks in enumerate(route):
            p.observe(1, [(layer, e) for e in picks])
            if layer == 1:
                got = p.propose(1, 2, 0 if t < 300 else 2, ())   # (budget 0: only measures)
                proposed += len(got)
                right += sum(k in [(2, e) for e in route[2]] for k, _ in got)
        p.end_pass(1)
    return right, proposed


def test_a_path_that_pairs_cannot_tell_is_proposed_right():
    right, proposed = precision_on_xor(True)
    assert proposed >= 150 and right >= 0.95 * proposed
    right, proposed = precision_on_xor(False)                # the pair counts alone
    assert right <= 0.75 * max(proposed, 1)


def test_fetches_of_hundreds_of_keys_stay_finite():
    r = Recall(5, 512, depth=4, temper=0.7, window=16)
    every = tuple(range(512))
    for _ in range(16):                                      # (prefills' unions: every expert)
        one_pass(r, 1, [every] * 5)
    # each pass's similarity ~1297, to the 12th: the sum passes float32's range
    v = r.votes(4, rows_of([(d, every) for d in range(1, 5)], 512))
    assert v is not None and 0.99 < v.min() and v.max() <= 1.0 + 1e-6
