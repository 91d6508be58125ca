"""Unit: the route trace format and ``k3d replay`` on small traces (pure: no daemon).

The real routing trace's replays and the CLI are tests/integration/test_replay_trace.py."""

import pytest

from k3d.observe.trace import BEGIN, DONE, FETCH, PREDICT, RouteTrace, TraceError, parse
from k3d.replay.engine import min_slots, run


def test_seed_lines_begin_a_token_where_the_layer_does_not_increase():
    lines = ["100 L0 n=2 miss=0 evict=0 wait=0 pf=0 pfu=0 7 0",
             "200 L1 n=2 miss=0 evict=0 wait=0 pf=0 pfu=0 3,6",      # the first format's comma-joined ids
             "300 L0 n=2 miss=0 evict=0 wait=0 pf=0 pfu=0 1 2"]
    ev = parse(lines)
    assert [e.kind for e in ev] == [FETCH, FETCH, BEGIN, FETCH]
    assert ev[1].keys == [(1, 3), (1, 6)] and ev[3].keys == [(0, 1), (0, 2)]
    assert {e.client for e in ev} == {0}


def test_written_lines_parse_back(tmp_path):
    path = tmp_path / "t.trace"
    t = RouteTrace(str(path), 0.0)
    t.fetch(0.001, 3, 0, [(0, 1), (0, 5), (2, 7)], 1, 0, 0, 0, 0)
    t.predict(0.001, 3, 0, [(1, 2), (1, 4)])
    t.begin(0.002, 3, 0)
    t.fetch(0.003, 3, 1, [(0, 1)], 0, 0, 0, 0, 2)
    t.bye(0.004, 3)
    t.close()
    text = path.read_text()
    assert "L0 n=3 miss=1 evict=0 wait=0 pf=0 pfu=0 1 5 2:7\n" in text
    ev = parse(text.splitlines())
    assert [e.kind for e in ev] == [FETCH, PREDICT, BEGIN, FETCH, "bye"]
    assert ev[0].keys == [(0, 1), (0, 5), (2, 7)] and ev[0].counts == (1, 0, 0, 0, 0)
    assert ev[1].keys == [(1, 2), (1, 4)] and ev[3].counts[-1] == 2


def test_epoch_growth_without_a_begin_line_is_a_new_token():
    ev = parse(["1 c=1 t=0 L0 n=1 5", "2 c=2 t=0 L0 n=1 5", "3 c=1 t=1 L0 n=1 6"])
    assert [(e.kind, e.client) for e in ev] == [(FETCH, 1), (FETCH, 2), (BEGIN, 1), (FETCH, 1)]


@pytest.mark.parametrize("line, what", [
    ("100 L0 n=2 7 x", "invalid literal"),
    ("100 L0 n=3 7 0", "n=3 but 2"),
    ("abc L0 1", "invalid literal"),
    ("100 L0 bogus=1 1", "unknown field"),
    ("100 c=1 t=0 predict", "without keys"),
    ("100 c=1 t=0 done", "without layers"),
    ("100 c=1 t=0 done 1 x", "'x' is not a layer number"),
])
def test_malformed_line_names_its_number(line, what):
    with pytest.raises(TraceError, match=rf"t.trace:2: malformed trace line .*{what}"):
        parse(["100 L0 n=1 1", line], "t.trace")


def test_min_slots_is_the_largest_token():
    ev = parse(["1 L0 n=2 1 2", "2 L1 n=2 1 2", "3 L0 n=1 1"])
    assert min_slots(ev) == 4
    assert run(ev, "lru", 4).misses == 4
    assert run(ev, "lru", 3).cache_full == 1       # the store refuses what cannot be pinned


def test_predictions_replayed_through_the_store():
    lines = []
    for t in range(20):
        for layer in range(4):
            lines.append(f"{t} c=1 t={t} L{layer} n=1 {(t + layer) % 3}")
            if layer < 3:
                lines.append(f"{t} c=1 t={t} predict {layer + 1}:{(t + layer + 1) % 3}")
        lines.append(f"{t} c=1 t={t} begin")
    ev = parse(lines)
    with_p = run(ev, "lru", 6)
    assert with_p.prefetched > 0 and with_p.prefetch_hits == with_p.prefetched and with_p.prefetch_unused == 0
    assert run(ev, "lru", 6, predictions=False).prefetched == 0


def test_done_lines_release_a_layer_mid_token(tmp_path):
    """A ``done`` line ends the client's pins of those layers before its ``begin``: a trace
    that needs every slot of a token at once without it fits with it."""
    path = tmp_path / "t.trace"
    t = RouteTrace(str(path), 0.0)
    t.fetch(0.001, 1, 0, [(0, 1), (0, 2)], 2, 0, 0, 0, 0)
    t.done(0.002, 1, 0, {2, 0})
    t.fetch(0.003, 1, 0, [(1, 1), (1, 2)], 2, 0, 0, 0, 0)
    t.close()
    text = path.read_text()
    assert " c=1 t=0 done 0 2\n" in text
    ev = parse(text.splitlines())
    assert [e.kind for e in ev] == [FETCH, DONE, FETCH] and ev[1].layers == (0, 2) and ev[1].keys == []
    assert min_slots(ev) == 2 and min_slots([e for e in ev if e.kind != DONE]) == 4
    with_done, without = run(ev, "lru", 2), run([e for e in ev if e.kind != DONE], "lru", 2)
    assert (with_done.cache_full, with_done.misses, with_done.evictions) == (0, 4, 2)
    assert without.cache_full == 1
