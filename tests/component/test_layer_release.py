"""Component: a layer's pins end with its compute (protocol 6 ``done``), against the real server loop.

- a layer a client released goes to another client's misses while the releasing
  client's later layers stay pinned (and their views keep their bytes); the
  release travels on the lease thread's beat, no extra request;
- a release never frees a predicted slot not used yet (predictions are judged at the
  token's end); a used one's pin goes with its layer;
- a fetch carrying a release applies it after the message's reports and before its
  own keys, so a layer fetched again is pinned afresh;
- the route trace records the releases, and ``k3d replay`` reproduces the daemon's
  counters from it;
- a ``done`` naming a layer the model lacks is a one-line error, after the reports
  and the release of its other layers (the client no longer counts their slots).
"""

import random

import pytest
from test_as_ready import hold
from test_server_component import ask, raw_dealer, reference, server  # noqa: F401 -- the fixture, and its helpers

import k3client
from helpers import poll_for
from k3client.protocol import PROTOCOL_VERSION, pack
from k3d.cache.predictions import PREDICT
from k3d.observe.trace import read
from k3d.replay.engine import run


def held_keys(srv, client) -> set:
    """The keys of the slots ``client``'s current token pins."""
    s = next(s for s in srv.sessions if s.client_id == client.client_id)
    return {srv.store.slot_key[slot] for slot in srv.store.policy.held(s.holder)}


def test_a_released_layer_goes_to_anothers_misses_while_later_layers_stay(server):  # noqa: F811
    srv = server(slots=4, lease_s=0.4, predict="off")
    with k3client.connect(srv.cfg.endpoint, name="a") as a, k3client.connect(srv.cfg.endpoint, name="b") as b:
        a.fetch(0, [0, 1])
        later = a.fetch(1, [0, 1])
        assert held_keys(srv, a) == {(0, 0), (0, 1), (1, 0), (1, 1)}
        with pytest.raises(k3client.CacheFull):
            b.fetch(2, [0, 1])                   # every slot is a's
        a.release_layer(0)
        # no request of a's: its lease thread's next beat carries the release
        poll_for(lambda: held_keys(srv, a) == {(1, 0), (1, 1)}, 5, lambda: f"a holds {held_keys(srv, a)}",
                 interval=0.01)
        got = b.fetch(2, [0, 1])                 # misses: they take layer 0's slots
        assert {e.slot for e in got} == {e.slot for e in later} ^ set(range(4))
        assert (0, 0) not in srv.store.key_slot and (0, 1) not in srv.store.key_slot
        for e in [*later, *got]:
            assert bytes(e.memory()) == reference(srv, (e.layer, e.expert))
        assert held_keys(srv, a) == {(1, 0), (1, 1)}
        st = srv.stats
        assert st.layers_done == 1 and st.pins_done == 2 and st.bad_reports == 0


def test_a_release_never_frees_a_predicted_slot(server):  # noqa: F811
    srv = server(slots=4, predict="client")
    with k3client.connect(srv.cfg.endpoint, name="a") as a, k3client.connect(srv.cfg.endpoint, name="b") as b:
        a.fetch(0, [0], predicted=[(1, 0), (1, 1)])
        poll_for(lambda: not srv.store.loads, 5, lambda: "predicted reads still loading", interval=0.01)
        sa = next(s for s in srv.sessions if s.client_id == a.client_id)
        predicted = set(srv.store.policy.held((PREDICT, a.client_id)))
        assert {srv.store.slot_key[s] for s in predicted} == {(1, 0), (1, 1)}
        a.release_layer(1)                       # the predicted layer: not a's fetches
        a.release_layer(0)
        a.status()                               # carries the releases
        assert not srv.store.policy.held(sa.holder)
        assert srv.store.policy.held((PREDICT, a.client_id)) == predicted
        with pytest.raises(k3client.CacheFull):
            b.fetch(2, [0, 1, 2])                # only layer 0's slot and one free one can go
        b.fetch(2, [0, 1])
        assert {srv.store.slot_key[s] for s in predicted} == {(1, 0), (1, 1)}
        a.fetch(1, [0, 1])                       # used: counted as predictions that came true
        a.release_layer(1)                       # used ones are no predictions any more: they go
        a.status()
        assert not srv.store.policy.held((PREDICT, a.client_id)) and not srv.store.policy.held(sa.holder)
        a.begin_token()
        assert srv.stats.prefetch_hits == 2 and srv.stats.prefetch_unused == 0


def test_a_fetch_carrying_a_release_pins_its_own_keys_afresh(server):  # noqa: F811
    """The release goes with the next message, a fetch of the same layer: it applies
    after the message's reports and before the fetch's keys, which stay pinned."""
    srv = server(slots=8, predict="off")
    with k3client.connect(srv.cfg.endpoint, name="a", hit_path="daemon") as a:
        a.fetch(0, [0, 1])
        a.release_layer(0)
        a.fetch(0, [1, 2])
        assert held_keys(srv, a) == {(0, 1), (0, 2)}
        assert srv.stats.pins_done == 2
        a.release_layer(0)
        a.begin_token()                          # a release on begin_token: moot, every pin goes
        assert srv.stats.layers_done == 1 and not held_keys(srv, a)   # (not applied: not counted)


def test_replay_is_exact_with_releases(server, tmp_path):  # noqa: F811
    """One client (its misses reuse a slot at once, so nothing evicts ahead), layers
    released as it goes: the trace's ``done`` lines replay to the daemon's counters.
    Replay finishes every read at once; so that the daemon's victims are replay's, each
    token begins once its predictions' reads are done (on a loaded machine a read the
    page cache could not serve at once goes to the pool and may still be loading when
    an unused prediction, unpinned at the token's end, is the next victim)."""
    trace = str(tmp_path / "route.trace")
    srv = server(slots=10, policy="lru", predict="client", trace=trace)
    rng = random.Random(3)
    with k3client.connect(srv.cfg.endpoint, name="r") as c:
        for _ in range(30):
            poll_for(lambda: not srv.store.loads, what="the token's reads to finish")
            c.begin_token()
            for layer in range(4):
                ahead = [(layer + 1, e) for e in rng.sample(range(16), 2)] if layer < 3 else None
                c.fetch(layer, sorted(rng.sample(range(16), 3)), predicted=ahead)
                if layer < 3:
                    c.release_layer(layer)
        c.begin_token()
        st = srv.status()["stats"]
    assert st["loading_skips"] == 0 and st["layers_done"] > 30 and st["pins_done"] > 0
    events = read(trace)
    assert sum(ev.kind == "done" for ev in events) > 30
    got = run(events, "lru", 10).as_dict()
    want = {k: st[k] for k in ("hits", "misses", "evictions", "prefetched", "prefetch_hits", "prefetch_unused")}
    assert {k: got[k] for k in want} == want
    assert want["evictions"] > 50
    without = run([ev for ev in events if ev.kind != "done"], "lru", 10).as_dict()
    assert without["hits"] != want["hits"] or without["evictions"] != want["evictions"]


def test_a_done_of_a_layer_the_model_lacks_is_one_line_and_reports_still_apply(server):  # noqa: F811
    srv = server(slots=8)
    with k3client.connect(srv.cfg.endpoint, name="a") as a:
        a.fetch(0, [0])
        a.begin_token()
        a.fetch(0, [0])                          # a hit answered here: reported next
        a._hits.release(9)                       # (Client.release_layer checks only the type)
        with pytest.raises(k3client.errors.BadRequest, match="done: layer 9 is not a layer of the model"):
            a.status()
        assert srv.stats.client_hits == 1
    s = raw_dealer(srv.cfg.endpoint)
    try:
        r = ask(s, pack({"v": PROTOCOL_VERSION, "op": "hello", "id": 1, "name": "raw", "pid": 0}))
        assert r["ok"]
        r = ask(s, pack({"v": PROTOCOL_VERSION, "op": "status", "id": 2, "done": ["0"]}))
        assert not r["ok"] and r["error"]["message"].startswith("done must be a list of layer numbers")
    finally:
        s.close(0)


def test_a_done_with_a_bad_layer_still_releases_the_good_ones(server):  # noqa: F811
    """A's lease thread carries its release of layer 0 with one of a layer the model lacks
    (``Client.release_layer`` refuses that at the call: put in the attachment's queue here,
    as a client of another version or a raw one could send it).  A stopped counting layer 0's slots
    toward its quota when the release left, so the daemon must release layer 0 even
    though it refuses the message: else A's next hits, within A's count, are over the
    daemon's, refused, unpinned, and B's misses rewrite them under A's views."""
    srv = server(slots=6, pin_quota=2, predict="off", lease_s=0.4)
    with k3client.connect(srv.cfg.endpoint, name="a") as a, k3client.connect(srv.cfg.endpoint, name="b") as b:
        for layer in (0, 1):
            b.fetch(layer, [0, 1])
            b.begin_token()
        a.fetch(0, [0, 1])                       # answered by a itself: its quota's two slots
        a.release_layer(0)
        with pytest.raises(k3client.UnknownExpert, match=r"release_layer\(9\): .* serves no layer 9 \(it has layers"):
            a.release_layer(9)
        a._at.release(9)
        poll_for(lambda: srv.stats.client_hits == 2 and not a._hits.done, 5, "a's reports", interval=0.01)
        views = a.fetch(1, [0, 1])               # answered by a itself: within what it counts
        poll_for(lambda: srv.stats.client_hits == 4, 5, "a's second reports", interval=0.01)
        assert srv.stats.bad_reports == 0 and held_keys(srv, a) == {(1, 0), (1, 1)}
        for layer, experts in ((2, [0, 1]), (2, [2, 3]), (3, [0, 1])):
            b.fetch(layer, experts)              # misses: the oldest unpinned are the victims
            b.begin_token()
        for e in views:
            assert bytes(e.memory()) == reference(srv, (1, e.expert))


def test_a_layer_fetched_again_over_the_local_quota_keeps_its_release(server):  # noqa: F811
    """Quota 4: A answers layer 0's four experts itself, releases the layer, then fetches
    two more of it.  Its own count (the release not sent yet) is full, so the daemon
    answers that fetch; the release must go with it (applied before its keys), not be
    cancelled by a lookup that answered nothing: else the daemon counts six pins and
    refuses a client that is within its quota."""
    srv = server(slots=8, pin_quota=4, predict="off")
    with k3client.connect(srv.cfg.endpoint, name="a") as a, k3client.connect(srv.cfg.endpoint, name="b") as b:
        for experts in ([0, 1, 2, 3], [4, 5]):
            b.fetch(0, experts)
            b.begin_token()
        a.fetch(0, [0, 1, 2, 3])                 # answered by a itself
        a.release_layer(0)
        got = a.fetch(0, [4, 5])
        assert held_keys(srv, a) == {(0, 4), (0, 5)} and srv.stats.pins_done == 4
        for e in got:
            assert bytes(e.memory()) == reference(srv, (0, e.expert))


def test_a_release_during_its_layers_stream_ends_the_stream(server):  # noqa: F811
    """A releases layer 0 inside its ``fetch_iter`` loop over layer 0, before the stream
    ended.  The lease thread's beat unpins the layer, the read still running included:
    a later part would name a slot nothing keeps, which B's misses then rewrite.  So
    the release ends the stream: its next step raises, and nothing more is yielded."""
    srv = server(slots=4, predict="off", lease_s=0.4)
    with k3client.connect(srv.cfg.endpoint, name="a") as a, k3client.connect(srv.cfg.endpoint, name="b") as b:
        a.fetch(0, [0])
        a.begin_token()
        (g,) = hold(srv, (0, 1))
        it = a.fetch_iter(0, [0, 1])
        assert next(it)[0] == 0                  # resident: at once
        a.release_layer(0)
        poll_for(lambda: srv.stats.layers_done == 1, 5, "a's release", interval=0.01)
        g.set()
        with pytest.raises(k3client.errors.K3Error, match="released layer 0, before the iteration ended"):
            next(it)
        poll_for(lambda: not srv.store.loads, 5, "the read of (0, 1)", interval=0.01)
        for experts in ([0, 1], [2, 3]):
            got = b.fetch(1, experts)            # misses: layer 0's slots are the oldest unpinned
            assert all(bytes(e.memory()) == reference(srv, (1, e.expert)) for e in got)
            b.begin_token()
        again = a.fetch(0, [1])                  # the next request: a's window opens with its reply
        assert bytes(again[0].memory()) == reference(srv, (0, 1)) and a._hits.open
