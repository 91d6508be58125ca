"""Unit: the MoE-aware cycle policy and Belady's OPT, with plain integers."""

import pytest

from k3d.cache.policy import CyclePolicy, UnknownPolicy, make
from k3d.cache.policy.opt import NEVER, OptPolicy, next_uses


def fill(p, keys):
    for s, k in enumerate(keys):
        p.visit(k[0])
        p.insert(s, k)


def test_passed_layer_goes_before_any_layer_ahead():
    p = CyclePolicy(layers=4)
    fill(p, [(0, 0), (1, 0), (2, 0), (3, 0)])       # one token: now at layer 3
    for _ in range(5):                              # (2, 0) is used every token: a sure thing
        for layer in range(4):
            p.visit(layer)
            if layer == 2:
                p.touch(2, (2, 0))
    p.visit(0)
    p.visit(1)
    p.visit(2)                                      # serving layer 2: layers 0-2 passed, 3 ahead
    assert p.passed(0) and p.passed(2) and not p.passed(3)
    assert p.victim() in (0, 1, 2)
    p.pin(0, "a")
    p.pin(1, "a")
    assert p.victim() == 2                          # passed beats ahead even when it is hot
    p.pin(2, "a")
    assert p.victim() == 3
    p.pin(3, "a")
    assert p.victim() is None and p.evictable() == 0
    p.check()


def test_among_layers_ahead_the_least_likely_per_step_goes():
    p = CyclePolicy(layers=8)
    fill(p, [(l, 0) for l in range(8)])
    for _ in range(4):                              # (5, 0) is used every token, (6, 0) never again
        for layer in range(8):
            p.visit(layer)
            if layer == 5:
                p.touch(5, (5, 0))
    p.visit(0)
    for s in range(1):
        p.pin(s, "h")
    # serving layer 0: layers 1..7 are ahead; 5 is hot, the cold ones are alike but
    # (7, 0) is furthest away, so it buys the fewest hits per slot-step
    assert p.victim() == 7
    assert p.usage.rate((5, 0)) > 0.5 > p.usage.rate((6, 0))
    p.check()


def test_within_a_layer_the_lower_decayed_count_goes_and_ties_go_to_the_lower_slot():
    p = CyclePolicy(layers=2)
    p.visit(0)
    p.insert(0, (1, 0))
    p.insert(1, (1, 1))
    p.insert(2, (1, 2))
    p.touch(1, (1, 1))
    p.visit(1)
    p.visit(0)
    assert p.victim() == 0                          # (1,0) and (1,2) tie on count: lower slot
    p.remove(0)
    assert p.victim() == 2
    p.check()


def test_predictions_are_not_uses_and_admission_compares_expected_reuse():
    p = CyclePolicy(layers=4)
    for _ in range(6):
        for layer in range(4):
            p.visit(layer)
            p.insert(layer, (layer, 0)) if _ == 0 else p.touch(layer, (layer, 0))
    p.insert(4, (1, 5), predicted=True)
    assert p.usage.rate((1, 5)) < p.usage.rate((1, 0))
    p.visit(0)                                      # serving 0: (1, x) is next
    # a confident prediction for layer 1 may displace a cold key far ahead, not a hot one
    assert p.admits((1, 5), 4, confidence=0.9)      # its own slot: rarely used
    assert not p.admits((1, 5), 1, confidence=0.05)
    assert p.admits((1, 5), 0, confidence=0.05)     # layer 0 has passed: always
    p.check()


def test_victim_cache_follows_pins_and_releases():
    p = CyclePolicy(layers=2)
    p.visit(0)
    p.insert(0, (0, 0))
    p.insert(1, (0, 1))
    p.visit(1)
    first = p.victim()
    p.pin(first, ("c", 0))
    second = p.victim()
    assert second != first and second is not None
    p.release(("c", 0))
    assert p.victim() == first
    p.check()


def test_export_restore_round_trip_and_refuses_garbage():
    p = CyclePolicy(layers=3)
    for t in range(5):
        for layer in range(3):
            p.visit(layer)
            key = (layer, t % 2)
            p.insert(10 * t + layer, key)
    q = CyclePolicy()
    q.restore(p.export())
    assert q.ranking() == p.ranking()
    assert all(abs(q.usage.rate(k) - p.usage.rate(k)) < 1e-9 for k in p.ranking())
    with pytest.raises(ValueError):
        CyclePolicy().restore({"keys": [["a", 1, 2, 3]]})
    with pytest.raises(ValueError):
        CyclePolicy().restore({"keys": [[0, 1, -5.0, 0]]})


def test_make_lists_the_known_policies():
    assert isinstance(make("cycle"), CyclePolicy)
    with pytest.raises(UnknownPolicy, match="known policies: cycle, lru"):
        make("arc")


def test_opt_evicts_the_key_used_furthest_ahead_and_skips_pins():
    future = [(0, 0), (0, 1), (0, 2), (0, 1), (0, 0), (0, 2)]
    assert next_uses(future) == [4, 3, 5, NEVER, NEVER, NEVER]
    p = OptPolicy(future)
    for s in range(3):
        p.insert(s, future[s])
    assert p.victim() == 2                          # (0,2) next at 5, furthest
    p.pin(2, "h")
    assert p.victim() == 0                          # then (0,0) at 4
    p.release("h")
    assert p.victim() == 2
    assert p.evictable(exclude={2}) == 2
    p.check()


def test_admission_of_the_victim_just_chosen_is_the_full_scores_comparison():
    """``admits`` on the slot ``victim`` returned takes that layer's cached rate: the same
    answer as comparing ``score``s afresh, for confidences on both sides of it."""
    p = CyclePolicy(layers=6)
    slot = 0
    for t in range(5):
        for layer in range(6):
            p.visit(layer)
            for e in range(3):
                if t == 0:
                    p.insert(slot, (layer, e))
                    slot += 1
                elif (e + t + layer) % 3:
                    p.touch(layer * 3 + e, (layer, e))
    p.visit(0)
    p.visit(1)
    seen = set()
    for _ in range(6):
        v = p.victim()
        key = p._key[v]
        assert p._cand[key[0]][0] == v              # (the cached rate is what admits takes)
        for conf in (0.01, 0.2, 0.5, 0.9, 0.99):
            for want in ((2, 7), (5, 7), (0, 7)):
                expect = p.score(key) > p.score(want, p=conf)
                assert p.admits(want, v, conf) == expect
                seen.add(expect)
        p.pin(v, "h")
    assert seen == {True, False}                    # both answers were exercised
    for s, key in p._key.items():                   # any resident slot, the candidate or not
        for conf in (0.01, 0.5, 0.99):
            for want in ((2, 7), (5, 7), (0, 7)):
                assert p.admits(want, s, conf) == (p.score(key) > p.score(want, p=conf))
    p.check()


@pytest.mark.parametrize("seed", range(6))
def test_victim_equals_a_full_scan_through_pins_releases_and_evictions(seed):
    """Slots unpinned wait unfiled until their layer is scored (``_pending``): whatever
    the interleaving of visits, uses, pins, layer releases, token ends and evictions,
    ``victim`` names the slot a full scan of every resident does."""
    import random

    rng = random.Random(seed)
    layers, experts, slots = 6, 12, 30
    p = CyclePolicy(layers=layers)
    key_of, free, token = {}, list(range(slots)), 0
    for step in range(1500):
        layer = step % layers
        if layer == 0:
            p.release(("c", token))                   # a token's end: every pin goes
            token += 1
        p.visit(layer)
        want = [(layer, e) for e in rng.sample(range(experts), 3)]
        resident = {k: s for s, k in key_of.items()}
        for key in want:
            s = resident.get(key)
            if s is None:
                if not free:
                    v = p.victim()
                    assert v == p._victim_scan(frozenset({-1})), f"step {step}"
                    if v is None:
                        continue
                    p.remove(v)
                    del key_of[v]
                    free.append(v)
                s = free.pop()
                key_of[s] = key
                p.insert(s, key, predicted=rng.random() < 0.3)
            else:
                p.touch(s, key)
            if rng.random() < 0.8:
                p.pin(s, ("c", token))
        if rng.random() < 0.2:                        # a layer released early
            mine = [s for s in p.held(("c", token)) if key_of[s][0] == layer]
            p.release_some(("c", token), mine)
        if step % 97 == 0:
            p.check()
    p.check()
