"""Unit: the cycle policy's usage statistics on their own (keys and layers, no slots)."""

import math

import pytest

from k3d.cache.policy.usage import UsageStats


def test_a_use_counts_half_after_half_life_visits_of_its_layer():
    u = UsageStats(half_life=4.0, prior_weight=0.0)
    u.visit(0)
    u.used(0, [(0, 0)])                             # used at visit 1
    for _ in range(4):
        u.visit(0)
    u.used(0, [(0, 1)])                             # used at visit 5: four visits later
    u.visit(1)                                      # (another layer's visits change nothing here)
    assert u.rate((0, 0)) == pytest.approx(u.rate((0, 1)) / 2)
    u.check()


def test_order_ranks_within_a_layer_and_holds_until_the_next_use():
    u = UsageStats()
    u.visit(2)
    u.used(2, [(2, 0), (2, 1)])
    u.visit(2)
    u.used(2, [(2, 0)])
    assert u.order((2, 0)) > u.order((2, 1)) > u.order((2, 7)) == -math.inf
    before = u.order((2, 1))
    for _ in range(5):
        u.visit(2)
    assert u.order((2, 1)) == before                # decay moves every key of the layer alike
    assert u.ranking()[:2] == [(2, 0), (2, 1)]
    u.used(2, [(2, 1)])
    assert u.order((2, 1)) > before
    u.check()


def test_restore_takes_an_export_back_or_changes_nothing():
    u = UsageStats()
    for layer in (0, 3):
        u.visit(layer)
        u.used(layer, [(layer, 5)])
    saved = u.export()
    q = UsageStats()
    assert q.restore(saved) == 4                    # the layers it names: 0..3
    assert q.export() == saved and q.ranking() == u.ranking()
    q.check()
    for bad in ({"keys": [[0, "x", 1.0, 0]]}, {"layers": [[0, -1, 0, 0]]}, {"keys": [[0, 1, 2e9, 0]]}):
        with pytest.raises(ValueError, match="cycle-policy statistics"):
            q.restore(bad)
        assert q.export() == saved


def test_a_restored_layer_visited_but_never_used_rates_its_keys():
    """A saved state whose layer was visited but never used says 0 experts for it: a key
    of that layer must still get a rate (it once divided by zero in the victim choice)."""
    from k3d.cache.policy.cycle import CyclePolicy

    p = CyclePolicy()
    p.visit(0)
    q = CyclePolicy()
    q.restore(p.export())
    q.insert(0, (0, 0), predicted=True)
    assert q.victim() == 0
