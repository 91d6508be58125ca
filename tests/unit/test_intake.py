"""The loop's intake (k3d/serve/intake.py): holds decided by the pacer reach the turns.

No socket is needed past ``receive``: requests are put in ``turns`` as
``receive`` puts them (arrival time, frames), with real sessions and counters.
"""

import time

from k3d.cache.sessions import Sessions
from k3d.config import Live
from k3d.observe.stats import Counters
from k3d.serve.intake import Intake
from k3d.serve.pacing import MAX_DELAY


def setup(n):
    sessions, stats = Sessions(), Counters()
    intake = Intake(None, sessions, stats, Live(max_share=2.0))
    clients = [sessions.attach(f"r{i}".encode(), f"c{i}", None, None, time.monotonic(), 10.0) for i in range(n)]
    return intake, clients, stats


def push(intake, s, tag):
    intake.turns.push(s.routing, (time.monotonic(), tag), 1)


def test_a_client_over_its_share_is_held_then_served_and_the_others_are_not():
    intake, cs, stats = setup(6)
    for s in cs[1:]:
        intake.charge(s.client_id, 0.02)
    intake.charge(cs[0].client_id, 0.5)        # 25x the others
    assert intake.turns.held_until(cs[0].routing) > time.monotonic() and cs[0].paced == 1 and stats.paced == 1
    assert 0 < cs[0].paced_s <= MAX_DELAY and stats.paced_seconds == cs[0].paced_s
    assert all(s.paced == 0 for s in cs[1:])
    push(intake, cs[0], "heavy")
    push(intake, cs[1], "light")
    now = time.monotonic()
    assert intake.next(now)[1] == "light"
    assert intake.next(now) is None            # only the held request waits
    wait_ms = intake.poll_ms()
    assert 1 <= wait_ms <= MAX_DELAY * 1000 + 1
    assert intake.next(intake.turns.held_until(cs[0].routing) + 0.001)[1] == "heavy"


def test_a_hold_is_never_stretched_by_more_charges():
    intake, cs, _ = setup(6)
    for s in cs[1:]:
        intake.charge(s.client_id, 0.02)
    intake.charge(cs[0].client_id, 0.5)
    until = intake.turns.held_until(cs[0].routing)
    intake.charge(cs[0].client_id, 5.0)        # its reads report while it is held
    assert intake.turns.held_until(cs[0].routing) == until and cs[0].paced == 1


def test_leaving_lifts_the_hold_and_forgets_the_usage():
    intake, cs, _ = setup(6)
    for s in cs[1:]:
        intake.charge(s.client_id, 0.02)
    intake.charge(cs[0].client_id, 0.5)
    push(intake, cs[0], "heavy")
    assert intake.next(time.monotonic()) is None
    intake.left(cs[0], dead=False)
    assert intake.pacer.usage(cs[0].client_id, time.monotonic()) == 0
    assert intake.next(time.monotonic())[1] == "heavy"     # not dead: its request is still answered


def test_a_dead_clients_requests_go_and_a_gone_clients_reads_are_not_charged():
    intake, cs, _ = setup(3)
    push(intake, cs[2], "x")
    intake.sessions.remove(cs[2])
    intake.left(cs[2], dead=True)
    assert intake.waiting == 0
    intake.charge(cs[2].client_id, 1.0)
    assert intake.pacer.usage(cs[2].client_id, time.monotonic()) == 0


def test_the_share_is_read_from_the_live_settings_at_each_use():
    intake, cs, stats = setup(6)
    intake.live.max_share = 0.0                 # a SIGHUP turned pacing off: nothing is charged or held
    assert not intake.pacing
    for s in cs[1:]:
        intake.charge(s.client_id, 0.02)
    intake.charge(cs[0].client_id, 0.5)
    assert intake.turns.held_until(cs[0].routing) == 0.0 and stats.paced == 0
    intake.live.max_share = 2.0                 # and back on: the same charges hold the heavy client
    for s in cs[1:]:
        intake.charge(s.client_id, 0.02)
    intake.charge(cs[0].client_id, 0.5)
    assert intake.turns.held_until(cs[0].routing) > time.monotonic() and stats.paced == 1
