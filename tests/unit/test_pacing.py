"""CPU fair share between clients (k3d/serve/pacing.py): pure, with explicit times."""

import math

import pytest

from k3d.config import Live
from k3d.serve.pacing import ACTIVE, FLOOR, MAX_DELAY, TAU, Pacer


def steady(p, rates, seconds, now=0.0, step=0.01):
    """Charge each client ``rates[c]`` CPU seconds per second for ``seconds``."""
    t = now
    while t < now + seconds - 1e-9:
        t += step
        for c, r in rates.items():
            p.charge(c, r * step, t)
    return t


def test_usage_decays_with_tau_and_the_total_is_the_sum():
    p = Pacer(Live(max_share=2.0))
    p.charge(1, 0.2, 0.0)
    p.charge(2, 0.1, 0.0)
    assert p.usage(1, TAU) == pytest.approx(0.2 / math.e)
    assert p.total(TAU) == pytest.approx(0.3 / math.e)
    p.forget(1, TAU)
    assert p.total(TAU) == pytest.approx(0.1 / math.e)
    assert p.usage(1, TAU) == 0.0


def test_steady_usage_approaches_rate_times_tau():
    p = Pacer(Live(max_share=2.0))
    t = steady(p, {1: 0.05}, 10 * TAU)
    assert p.usage(1, t) == pytest.approx(0.05 * TAU, rel=0.02)


def test_one_heavy_client_among_many_waits_and_the_others_never():
    p = Pacer(Live(max_share=2.0))
    rates = {c: 0.02 for c in range(16)}
    rates[99] = 0.2                           # ten times the others
    t = steady(p, rates, 5 * TAU)
    assert all(p.delay(c, t) == 0 for c in range(16))
    d = p.delay(99, t)
    assert 0 < d <= MAX_DELAY
    # the wait is what it takes for its usage to decay to its cap, 2x the others' average
    others = p.total(t) - p.usage(99, t)
    cap = 2.0 * others / (17 - 2.0)
    assert d == pytest.approx(min(MAX_DELAY, TAU * math.log(p.usage(99, t) / cap)))


def test_a_client_alone_or_with_one_other_is_never_paced():
    for n in (1, 2):
        p = Pacer(Live(max_share=2.0))
        rates = {0: 0.9, **{c: 0.001 for c in range(1, n)}}
        t = steady(p, rates, 3 * TAU)
        assert p.delay(0, t) == 0


def test_under_the_floor_nobody_waits():
    p = Pacer(Live(max_share=2.0))
    rates = {c: 0.0001 for c in range(10)}
    rates[99] = FLOOR * 0.9                   # 90x the others, but under the floor
    t = steady(p, rates, 5 * TAU)
    assert p.delay(99, t) == 0


def test_share_zero_turns_pacing_off():
    p = Pacer(Live(max_share=0))
    rates = {c: 0.01 for c in range(10)}
    rates[99] = 0.5
    t = steady(p, rates, 3 * TAU)
    assert p.delay(99, t) == 0


def test_clients_idle_for_long_stop_counting_as_active():
    p = Pacer(Live(max_share=2.0))
    t = steady(p, {c: 0.02 for c in range(10)}, TAU)
    t = steady(p, {0: 0.3, 1: 0.02}, 5 * TAU, now=t)   # the other eight went quiet
    assert p.active(t) == 2
    assert p.delay(0, t) == 0


def test_a_paced_client_settles_at_its_cap():
    """Simulate the loop: the heavy client asks for 0.5 CPU-s/s but waits whenever told to."""
    p = Pacer(Live(max_share=2.0))
    step, t, next_ok, got = 0.001, 0.0, 0.0, 0.0
    while t < 20 * TAU:
        t += step
        for c in range(16):
            p.charge(c, 0.02 * step, t)
        if t >= next_ok:
            p.charge(99, 0.5 * step, t)
            got += 0.5 * step if t > 10 * TAU else 0
            next_ok = t + p.delay(99, t)
    rate = got / (10 * TAU)
    cap_rate = 2.0 * 16 * 0.02 / (17 - 2.0)  # 2x the others' average, as a rate
    assert cap_rate * 0.8 < rate < cap_rate * 1.3


def test_clients_that_send_now_and_then_do_not_pull_a_busy_ones_cap_to_nothing():
    p = Pacer(Live(max_share=2.0))
    t = steady(p, {1: 0.0005, 2: 0.0005, 3: 0.03}, 3 * TAU)
    # each near-idle client counts FLOOR: cap = 2 * 2 * FLOOR / (3 - 2) = 4 % of a core > 3 %
    assert p.delay(3, t) == 0
    t = steady(p, {1: 0.0005, 2: 0.0005, 3: 0.08}, 5 * TAU, now=t)
    assert p.delay(3, t) > 0                  # 8 % is over it


def test_a_wait_too_short_to_hold_is_none():
    p = Pacer(Live(max_share=2.0))
    t = steady(p, {c: 0.02 for c in range(16)}, 5 * TAU)
    others = p.total(t)
    cap = 2.0 * others / (17 - 2.0)
    p.charge(99, cap * 1.0005, t)             # ln(1.0005) s = 0.5 ms
    assert p.delay(99, t) == 0
    p.charge(99, cap * 0.01, t)               # 1 % over: ~10 ms
    assert 0.005 < p.delay(99, t) < 0.02


def test_when_the_others_stop_the_holds_stop_within_active():
    p = Pacer(Live(max_share=2.0))
    rates = {c: 0.02 for c in range(16)}
    rates[99] = 0.3
    t = steady(p, rates, 3 * TAU)
    assert p.delay(99, t) > 0
    t = steady(p, {99: 0.3}, ACTIVE + 0.05, now=t)
    assert p.delay(99, t) == 0
