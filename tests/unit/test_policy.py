"""Unit: the pure LRU + pin policy, with plain integers."""

from k3d.cache.policy import LruPolicy


def test_victim_is_least_recently_used_unpinned():
    p = LruPolicy()
    for s in (0, 1, 2):
        p.insert(s)
    assert p.victim() == 0
    p.touch(0)
    assert p.victim() == 1
    p.pin(1, "a")
    assert p.victim() == 2
    p.pin(2, "b")
    assert p.victim() == 0
    p.pin(0, "a")
    assert p.victim() is None
    assert p.evictable() == 0
    p.check()


def test_release_unpins_only_that_holder():
    p = LruPolicy()
    p.insert(5)
    p.pin(5, ("c1", 0))
    p.pin(5, ("c2", 0))
    assert p.release(("c1", 0)) == [5]
    assert p.pinned(5) and p.victim() is None
    p.release(("c2", 0))
    assert not p.pinned(5) and p.victim() == 5
    p.check()


def test_pin_is_idempotent_per_holder():
    p = LruPolicy()
    p.insert(1)
    assert p.pin(1, "h") is True
    assert p.pin(1, "h") is False
    assert p.release("h") == [1]
    assert not p.pinned(1)


def test_demote_and_exclude():
    p = LruPolicy()
    for s in range(4):
        p.insert(s)
    p.demote(3)
    assert p.victim() == 3
    assert p.victim(exclude={3}) == 0
    assert p.evictable(exclude={3, 0}) == 2


def test_remove_drops_recency_and_pins():
    p = LruPolicy()
    p.insert(7)
    p.pin(7, "h")
    p.remove(7)
    assert not p.has(7) and not p.pinned(7)
    assert p.held("h") == set()
    p.check()


def test_pins_on_not_ready_slots_block_eviction_once_ready():
    p = LruPolicy()
    p.pin(3, "h")        # pinned while loading
    p.insert(3)          # became ready
    assert p.victim() is None
