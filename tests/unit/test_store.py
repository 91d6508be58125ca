"""Unit: the slot store's cache semantics (no sockets, no threads)."""

import pytest

from helpers import lru_order
from k3client.errors import CacheFull, QuotaExceeded
from k3d.cache.slots import LOADING, READY
from k3d.cache.store import Store
from k3d.config import Live


def ready(store, plan):
    for s in plan.new_loads:
        store.complete(s, None)


def test_miss_then_hit_then_wait():
    st = Store(4)
    p = st.fetch((1, 0), [(0, 1), (0, 2)])
    assert p.misses == 2 and p.new_loads == p.slots and p.waiting == set(p.slots)
    q = st.fetch((2, 0), [(0, 1)])             # another client while it loads
    assert q.waited == 1 and q.misses == 0 and q.new_loads == []
    ready(st, p)
    r = st.fetch((1, 0), [(0, 2)])
    assert r.waiting == set() and r.misses == 0
    assert (st.stats.hits, st.stats.misses, st.stats.waited) == (2, 2, 1)
    st.check()


def test_evicts_lru_unpinned_and_only_that():
    st = Store(2)
    ready(st, st.fetch((1, 0), [(0, 0)]))
    ready(st, st.fetch((1, 0), [(0, 1)]))
    st.end_epoch(1, (1, 0))
    st.fetch((1, 1), [(0, 0)])                # touch (0,0): (0,1) is now LRU
    st.end_epoch(1, (1, 1))
    p = st.fetch((1, 2), [(0, 2)])
    assert p.evictions == 1
    assert (0, 1) not in st.key_slot and (0, 0) in st.key_slot
    st.check()


def test_cache_full_changes_nothing():
    st = Store(2)
    ready(st, st.fetch((1, 0), [(0, 0), (0, 1)]))
    before = (dict(st.key_slot), lru_order(st.policy, st.slot_key), st.stats.as_dict())
    with pytest.raises(CacheFull, match=r"2 of 2 slots pinned"):
        st.fetch((2, 0), [(0, 0), (0, 5)])
    after_stats = st.stats.as_dict()
    assert after_stats.pop("cache_full") == 1
    before[2].pop("cache_full")
    assert (dict(st.key_slot), lru_order(st.policy, st.slot_key), after_stats) == before
    assert not st.policy.held((2, 0))
    st.check()


def test_hits_in_the_same_fetch_are_not_evicted_for_its_misses():
    st = Store(2)
    ready(st, st.fetch((1, 0), [(0, 0), (0, 1)]))
    st.end_epoch(1, (1, 0))
    with pytest.raises(CacheFull):
        st.fetch((1, 1), [(0, 0), (0, 1), (0, 2)])
    p = st.fetch((1, 1), [(0, 0), (0, 2)])   # (0,1) is the only victim
    assert p.evictions == 1 and (0, 0) in st.key_slot
    st.check()


def test_predictions_stop_at_first_without_a_slot_and_unused_are_demoted():
    st = Store(3)
    ready(st, st.fetch((1, 0), [(0, 0), (0, 1)]))   # 2 pinned, 1 free
    started = st.predict(1, [(1, 0), (1, 1), (1, 2)])
    assert len(started) == 1 and st.state[started[0]] == LOADING
    st.complete(started[0], None)
    released, unused = st.end_epoch(1, (1, 0))
    assert (released, unused) == (2, 1)
    assert st.policy.victim() == started[0]      # demoted: next victim
    assert st.stats.prefetched == 1 and st.stats.prefetch_unused == 1
    st.check()


def test_fetched_prediction_counts_as_prefetch_hit():
    st = Store(3)
    [s] = st.predict(9, [(2, 3)])
    p = st.fetch((1, 0), [(2, 3)])
    assert p.waited == 1 and p.promote == [s] and p.prefetched_hits == 1
    st.complete(s, None)
    assert st.end_epoch(9, (9, 0)) == (0, 0)
    assert st.stats.prefetch_unused == 0 and st.stats.prefetch_hits == 1


def test_failed_read_frees_slot_and_drops_pins():
    st = Store(2)
    p = st.fetch((1, 0), [(0, 0)])
    st.complete(p.slots[0], "EIO")
    assert (0, 0) not in st.key_slot and st.stats.errors == 1
    assert not st.policy.pinned(p.slots[0])
    q = st.fetch((1, 0), [(0, 0)])                 # retried as a miss
    assert q.misses == 1
    st.check()


def test_quota():
    st = Store(8, Live(pin_quota=2))
    st.fetch((1, 0), [(0, 0), (0, 1)])
    with pytest.raises(QuotaExceeded, match="quota is 2"):
        st.fetch((1, 0), [(0, 2)])
    st.fetch((2, 0), [(0, 2)])                     # others unaffected
    st.check()


def test_each_key_counts_one_hit_or_one_miss():
    st = Store(4)
    keys = [(0, i) for i in range(3)]
    ready(st, st.fetch((1, 0), keys))
    st.fetch((2, 0), keys + [(0, 3)])
    assert st.stats.hits + st.stats.misses == 7
    assert all(st.state[s] == READY for s in st.key_slot.values() if s not in st.loads)


def test_unused_prediction_fetched_while_loading_is_not_demoted():
    st = Store(4)
    ready(st, st.fetch((1, 0), [(0, 0)]))
    [s] = st.predict(9, [(1, 5)])
    st.end_epoch(9, (9, 0))                  # predictor moved on: counted unused
    st.fetch((2, 0), [(1, 5)])               # but another client needs it now
    st.complete(s, None)
    assert lru_order(st.policy, st.slot_key)[-1] == s    # most recently used, not the next victim
    st.check()


def test_resident_rows_follow_the_key_map():
    """``Store.resident`` (one byte per key, the predictor's residency query) equals
    ``key_slot`` through misses, evictions, predictions and failed reads."""
    st = Store(3)
    ready(st, st.fetch((1, 0), [(0, 1), (2, 5)]))
    assert st.resident.row(0, 4) == b"\x00\x01\x00\x00" and st.resident.row(2, 8) == bytes(5) + b"\x01\x00\x00"
    assert st.resident.row(1, 3) == bytes(3) and st.resident.row(2, 2) == bytes(2)
    st.end_epoch(1, (1, 0))
    ready(st, st.fetch((1, 1), [(0, 3), (1, 0)]))            # evicts one of the first two
    st.check()
    assert st.resident.row(0, 4)[1] + st.resident.row(2, 6)[5] == 1 and st.resident.row(0, 4)[3] == 1
    st.end_epoch(1, (1, 1))
    (s,) = st.predict(7, [(3, 2)])                           # a prediction's read fails
    assert st.resident.row(3, 3) == b"\x00\x00\x01"
    st.complete(s, "boom")
    assert st.resident.row(3, 3) == bytes(3) and (3, 2) not in st.resident
    st.check()
    row = st.resident.row(1, 2)
    ready(st, st.fetch((1, 2), [(1, 1)]))
    assert row == b"\x01\x00" and st.resident.row(1, 2) == b"\x01\x01"   # a row is a snapshot
    st.check()
