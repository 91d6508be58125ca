"""Deficit round-robin of the server loop (k3d/serve/turns.py)."""

from hypothesis import given, strategies as st

from k3d.serve.turns import MAX_COST, QUANTUM, Turns, cost_of


def drain(t):
    out = []
    while (item := t.pop()) is not None:
        out.append(item)
    return out


def test_fifo_within_a_client_round_robin_between():
    t = Turns()
    for i in range(3):
        t.push(b"a", f"a{i}", 1)
    t.push(b"b", "b0", 1)
    # a's turn covers all three cheap requests (budget per turn), then b
    assert drain(t) == ["a0", "a1", "a2", "b0"]
    assert len(t) == 0


def test_a_flood_of_costly_requests_yields_to_cheap_ones():
    t = Turns()
    for i in range(4):
        t.push(b"abuser", f"big{i}", MAX_COST)
    for i in range(4):
        t.push(b"good", f"f{i}", cost_of(40))
    order = drain(t)
    # the good client's fetches are all served before the abuser's second big request
    assert order.index("f3") < order.index("big1")
    assert sorted(order) == sorted([f"big{i}" for i in range(4)] + [f"f{i}" for i in range(4)])


def test_one_turn_budget():
    t = Turns(quantum=10)
    for i in range(5):
        t.push(b"a", f"a{i}", 4)
        t.push(b"b", f"b{i}", 4)
    assert drain(t)[:4] == ["a0", "a1", "b0", "b1"]   # 2 x 4 fit a quantum of 10


def test_forget_drops_a_leaving_clients_requests():
    t = Turns()
    t.push(b"a", 1, 1)
    t.push(b"b", 2, 1)
    t.push(b"a", 3, 1)
    assert t.forget(b"a") == 2 and t.forget(b"zz") == 0
    assert drain(t) == [2]


def test_cost_grows_with_size_and_is_capped():
    assert cost_of(0) == 1 and cost_of(800) > cost_of(80) and cost_of(10**9) == MAX_COST <= 4 * QUANTUM


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, MAX_COST)), max_size=200))
def test_everything_pushed_comes_out_once_in_client_order(pushes):
    t = Turns()
    for n, (client, cost) in enumerate(pushes):
        t.push(bytes([client]), (client, n), cost)
    out = drain(t)
    assert sorted(out) == sorted((c, n) for n, (c, _) in enumerate(pushes))
    for client in range(6):
        mine = [n for c, n in out if c == client]
        assert mine == sorted(mine)


# -- holds (k3d/serve/pacing.py decides them) -------------------------------------------------
def test_a_held_client_keeps_its_requests_in_order_and_is_passed_by():
    t = Turns()
    t.push(b"a", "a0", 1)
    t.push(b"a", "a1", 1)
    t.push(b"b", "b0", 1)
    t.hold(b"a", until=5.0)
    assert t.ready(1.0)
    assert t.pop(1.0) == "b0"
    assert not t.ready(1.0) and t.pop(1.0) is None and len(t) == 2
    assert t.next_release() == 5.0
    assert t.pop(5.0) == "a0" and t.pop(5.0) == "a1"
    assert t.next_release() is None and len(t) == 0


def test_a_hold_covers_requests_that_arrive_later_and_release_lifts_it():
    t = Turns()
    t.hold(b"a", until=9.0)
    assert t.next_release() is None          # nothing of a's waits yet
    t.push(b"a", "a0", 1)
    assert t.pop(2.0) is None and t.next_release() == 9.0
    t.release(b"a")
    assert t.pop(2.0) == "a0"


def test_forget_drops_the_hold_with_the_requests():
    t = Turns()
    t.push(b"a", "a0", 1)
    t.hold(b"a", until=9.0)
    assert t.forget(b"a") == 1
    t.push(b"a", "new", 1)
    assert t.pop(0.0) == "new"


@given(st.lists(st.tuples(st.sampled_from([b"a", b"b", b"c"]), st.integers(1, MAX_COST)), max_size=40),
       st.sets(st.sampled_from([b"a", b"b", b"c"])))
def test_holds_delay_but_never_lose_or_reorder(pushes, held):
    t = Turns()
    for i, (c, cost) in enumerate(pushes):
        t.push(c, (c, i), cost)
    for c in held:
        t.hold(c, until=10.0)
    early = drain_at(t, 1.0)
    assert all(c not in held for c, _ in early)
    late = drain_at(t, 10.0)
    assert sorted(early + late) == sorted((c, i) for i, (c, _) in enumerate(pushes))
    for c in (b"a", b"b", b"c"):
        mine = [i for cc, i in early + late if cc == c]
        assert mine == sorted(mine)


def drain_at(t, now):
    out = []
    while (item := t.pop(now)) is not None:
        out.append(item)
    return out
