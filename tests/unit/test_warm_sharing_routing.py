"""Unit: the warm-restart state file, the sharing comparison and the demo's router."""

import json
import logging
import os

import numpy as np
import pytest

from k3d.cache.policy import CyclePolicy
from k3d.cache.store import Store
from k3d.cache.warm import STALE_TMP_S, Warmup, load, prune, save, state_path
from k3d.demo.routing import DEMO, routes, statistics
from k3d.observe.trace import BEGIN, parse
from k3d.replay.sharing import compare, interleave


class FakeSource:
    keys = {(l, e): None for l in range(2) for e in range(4)}


def test_state_file_is_named_by_checkpoint_and_only_gone_checkpoints_are_pruned(tmp_path):
    d = tmp_path / "state"
    assert state_path(str(d), "ab" * 32) == str(d / f"state-{'ab' * 8}.json")
    assert prune(str(d), "") == []                       # no directory yet: nothing to do
    d.mkdir()
    now = 1_000_000.0
    live, dead = tmp_path / "live-ckpt", tmp_path / "dead-ckpt"
    live.mkdir()
    kept, removed = [], []
    for i in range(12):                                  # more than any count bound
        p = d / f"state-{i:02d}.json"
        src = [str(live), str(dead), "https://example.com/m", None][i % 4]
        save(str(p), f"print-{i}", "cycle", [], {}, source=src)
        (removed if src == str(dead) else kept).append(str(p))
    own = d / "state-own.json"
    save(str(own), "print-own", "cycle", [], {}, source=str(dead))    # our own: kept even so
    for name, text in (("state-old.json", '{"format": "k3d-policy-state"}'), ("state-bad.json", "{")):
        (d / name).write_text(text)                      # written before "source", or unreadable: kept
    crashed, in_flight, other = d / ".state-a.tmp", d / ".state-b.tmp", d / "notes.txt"
    for p, age in ((crashed, 2 * STALE_TMP_S), (in_flight, 1), (other, 10 * STALE_TMP_S)):
        p.write_text("x")
        os.utime(p, (now - age, now - age))
    gone = prune(str(d), str(own), now=now)
    assert sorted(p for p, _ in gone) == sorted(removed + [str(crashed)])
    assert {why for p, why in gone if p in removed} == {"its checkpoint is gone"}
    assert sorted(os.listdir(d)) == sorted([os.path.basename(p) for p in kept] + [
        "state-own.json", "state-old.json", "state-bad.json", ".state-b.tmp", "notes.txt"])


def test_state_file_round_trip_and_every_bad_file_is_none(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="k3d")
    path = str(tmp_path / "d" / "state-x.json")
    save(path, "print-A", "cycle", [(1, 2), (0, 3), (9, 9)], {"keys": []})
    assert not [n for n in os.listdir(tmp_path / "d") if n.endswith(".tmp")]      # renamed, no leftovers
    doc = load(path, "print-A", FakeSource.keys)
    assert doc["hot"] == [(1, 2), (0, 3)]                 # (9, 9) is not in this model: dropped
    assert load(path, "print-B", FakeSource.keys) is None
    assert "another checkpoint or layout" in caplog.text
    assert load(str(tmp_path / "missing.json"), "print-A", FakeSource.keys) is None
    assert "no state file" in caplog.text
    raw = open(path).read()
    for bad in (raw[: len(raw) // 2], "\xff\xfe", json.dumps({"format": "other"}),
                raw.replace('"hot":[[1,2]', '"hot":[["x",2]')):
        with open(path, "w", encoding="utf-8", errors="surrogateescape") as f:
            f.write(bad)
        assert load(path, "print-A", FakeSource.keys) is None


def test_preload_fills_free_slots_only_hottest_most_recent_and_reports_progress():
    st = Store(3, policy=CyclePolicy())
    st.fetch((1, 0), [(0, 0)])
    slots = st.preload([(1, 1), (1, 2), (1, 3), (0, 0)])  # 2 free slots; (0, 0) is resident
    assert [st.slot_key[s] for s in slots] == [(1, 1), (1, 2)]
    assert st.stats.warm_loaded == 2 and not st.policy.pinned(slots[0])
    w = Warmup([(s, st.slot_key[s]) for s in slots], 4)
    assert w.progress(st)["loading"] == 2 and not w.progress(st)["done"]
    for s in [*slots, 0]:
        st.complete(s, None)
    assert w.progress(st) | {"done": True} == w.progress(st) and w.progress(st)["ready"] == 2
    st.check()


def test_sharing_interleaves_offset_clients_with_their_own_tokens():
    lines = [f"{t} L{l} n=1 {(t * 3 + l) % 4}" for t in range(8) for l in range(2)]
    ev = parse(lines)
    shared, per = interleave(ev, 2, offset=4)
    assert [e.client for e in shared[:4]] == [1, 2, 1, 2]
    assert per[1][0].keys == [(0, (4 * 3) % 4)]          # client 2 starts at token 4
    assert sum(e.kind == BEGIN for e in per[0]) == 8
    res = compare(ev, 2, [8], ["lru"], offset=4)["lru"][8]
    assert res["private_slots"] == 4 and 0 <= res["private"] <= res["shared"] <= 1
    with pytest.raises(ValueError, match="below one token's pins"):
        compare(ev, 2, [2], ["lru"])


def test_demo_router_has_the_shared_traces_statistics_and_an_honest_predictor():
    r, pred = routes(300, layers=8, experts=32, topk=4, seed=2, **DEMO)     # the demo's shape
    st = statistics(r, 32)
    assert 1.2 < st["reuse_ratio"] < 1.7          # the shared trace: ~1.4x chance
    assert st["busiest_vs_mean"] < 2.0             # flatter than Zipf(1.1) (busiest ~9x mean at 32 experts)
    r8, _ = routes(300, layers=32, experts=8, topk=2, seed=2)                # the shared trace's shape
    assert 1.25 < statistics(r8, 8)["reuse_ratio"] < 1.6
    recall = np.mean([len(set(pred[t, l]) & set(r[t, l + 1])) / 4 for t in range(300) for l in range(7)])
    assert 0.55 < recall < 0.95                    # right often, never by construction
