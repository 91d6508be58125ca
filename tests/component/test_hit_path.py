"""Component: hits answered in the client from the shared index, against the real server loop.

- a fetch of resident experts sends nothing; the daemon counts it with the
  client's next message, as the same fetch through the daemon;
- a fetch through the daemon answered at once ends the client's wait, as any reply
  does (deferred reuse holds evicted slots for it again);
- the index is read-only for clients (sealed memfd), like the arena;
- a garbage hit report is a one-line error for its sender, and others go on;
- views of a slot already seen are the same objects (no new mapping);
- ``hit_path="daemon"`` / ``K3D_HIT_PATH`` keep the round trip; a bad value is one line;
- a client refused ``SlotsBusy`` answers nothing itself until its next request, and
  the daemon leaves it unsynced meanwhile.
"""

import mmap
import os
import socket

import pytest
from test_server_component import ask, raw_dealer, reference, server  # noqa: F401 -- the fixture, and its helpers

import k3client
from helpers import poll_for
from k3client.errors import SlotsBusy
from k3client.protocol import PROTOCOL_VERSION, pack


def test_a_hit_sends_nothing_and_is_counted_with_the_next_message(server):  # noqa: F811
    srv = server()
    with k3client.connect(srv.cfg.endpoint, name="h") as c:
        assert c.hit_path == "client"
        c.fetch(0, [1, 2])                       # misses: through the daemon
        c.begin_token()
        before = srv.stats.fetches
        ex = c.fetch(0, [1, 2])                  # hits: answered here
        assert [e.slot for e in ex] == [e.slot for e in c.fetch(0, [2, 1])][::-1]
        assert srv.stats.fetches == before       # the daemon has heard nothing yet
        for e in ex:                             # (read before begin_token: then their pins end)
            assert bytes(e.memory()) == reference(srv, (0, e.expert))
        c.begin_token()                          # carries the two reports
        st = srv.stats
        assert st.fetches == before + 2 and st.hits == 4 and st.misses == 2 and st.client_hits == 4


def test_a_fetch_answered_at_once_ends_the_clients_wait(server):  # noqa: F811
    """A fetch through the daemon whose keys are all ready (it went because of a
    prediction) is answered at once.  That reply is the client's quiescent point like
    any other: afterwards it answers hits from the index again, so a slot evicted
    now must wait for it, not be reused under its views (found by the stress test:
    the client stayed "blocked in a request" and 12 views read another key's bytes)."""
    srv = server()
    with k3client.connect(srv.cfg.endpoint, name="a") as a:
        a.fetch(0, [1, 2])                        # misses: read, then ready
        a.begin_token()
        a.fetch(0, [1, 2], predicted=[(1, 3)])    # ready keys + a prediction: through the daemon
        reader = srv.store.reuse.viewers[a.client_id]
        # not "blocked in a request" any more (the server thread marks it just after
        # the reply leaves, so the client may see the reply first)
        poll_for(lambda: reader.synced != float("inf"), 5, lambda: f"still waiting: {reader}", interval=0.01)
        assert not srv.store.reuse.could_reuse_now()
        before = srv.stats.fetches
        a.fetch(0, [1])                           # answered here, from the index ...
        assert srv.stats.fetches == before        # ... while the daemon holds evicted slots for it


def test_index_cannot_be_mapped_writable(server):  # noqa: F811
    srv = server()
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.connect(srv.arena_socket)
        _, fds, _, _ = socket.recv_fds(s, 4096, 2)
    try:
        assert len(fds) == 2
        with pytest.raises(PermissionError):
            mmap.mmap(fds[1], srv.index.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(OSError):
            os.write(fds[1], b"x")
    finally:
        for fd in fds:
            os.close(fd)


@pytest.mark.parametrize("hits,words", [
    ("x", "hits must be a list"),
    ([[0, [1], [10**6]]], "not slots of this arena"),
    ([[0, [1, 2], [0]]], "is not a [layer, [experts], [slots]] report"),
    ([[0, [99], [0]]], "(layer 0, expert 99)"),
    ([[0, [1, 1], [0, 1]]], "duplicate key"),
    # checked over the whole message at once: a bad entry anywhere is named
    ([[0, [1], [0]], [1, [True], [1]]], "is not a [layer, expert] pair of integers"),
    ([[0, [1], [0]], [1, [1.0], [1]]], "is not a [layer, expert] pair of integers"),
    ([[0, [1], [0]], [1, [2], [-1]]], "not slots of this arena"),
    ([[0, [1], [0]], [1, [2], [True]]], "not slots of this arena"),
    ([[0, [1], [0]], [True, [2], [1]]], "is not a [layer, expert] pair of integers"),
])
def test_garbage_hit_reports_are_one_line_errors_and_others_go_on(server, hits, words):  # noqa: F811
    srv = server()
    s = raw_dealer(srv.cfg.endpoint)
    assert ask(s, pack({"v": PROTOCOL_VERSION, "op": "hello", "id": 1, "name": "liar", "hit_path": True}))["ok"]
    before = srv.stats.hits
    r = ask(s, pack({"v": PROTOCOL_VERSION, "op": "begin_token", "id": 2, "hits": hits}))
    assert r["ok"] is False and r["error"]["code"] in ("bad_request", "unknown_expert"), r
    assert words in r["error"]["message"] and "\n" not in r["error"]["message"]
    assert srv.stats.hits == before                       # nothing of it was applied
    s.close()
    with k3client.connect(srv.cfg.endpoint, name="ok") as c:
        assert c.fetch(0, [0])[0].expert == 0


def test_views_of_a_slot_seen_before_are_reused(server):  # noqa: F811
    srv = server()
    with k3client.connect(srv.cfg.endpoint, name="v") as c:
        name = c.layout[0].name
        a = c.fetch(1, [3])[0]
        view = a.array(name)
        c.begin_token()
        b = c.fetch(1, [3])[0]
        assert a.slot == b.slot and view is b.array(name)


def test_hit_path_daemon_keeps_the_round_trip(server, monkeypatch):  # noqa: F811
    srv = server()
    with k3client.connect(srv.cfg.endpoint, name="d", hit_path="daemon") as c:
        c.fetch(0, [1])
        before = srv.stats.fetches
        c.fetch(0, [1])
        assert srv.stats.fetches == before + 1 and srv.stats.client_hits == 0
        me = poll_for(lambda: next((x for x in c.status()["clients"] if x["name"] == "d"), None), 2, "client d")
        assert me["hit_path"] == "daemon"
    monkeypatch.setenv("K3D_HIT_PATH", "daemon")
    with k3client.connect(srv.cfg.endpoint, name="e") as c:
        assert c.hit_path == "daemon"
    monkeypatch.setenv("K3D_HIT_PATH", "sometimes")
    with pytest.raises(k3client.K3Error, match="must be 'client' or 'daemon'"):
        k3client.connect(srv.cfg.endpoint, name="f")


def test_a_client_refused_slots_busy_reads_nothing_until_its_next_request(server):  # noqa: F811
    """Near the arena's floor a fetch is answered ``SlotsBusy`` while the free slots wait
    for another client's next request.  The refused client retries and answers no hit
    itself until a later request's reply, so the daemon leaves it unsynced: its retries
    hold no evicted slot from reuse (several clients at the floor waited on each
    other's backoff sleeps: the demo's p99 was ~1 s)."""
    srv = server(slots=4)
    with k3client.connect(srv.cfg.endpoint, name="a") as a, \
            k3client.connect(srv.cfg.endpoint, name="b", timeout=0.3) as b:
        a.fetch(0, [0, 1, 2, 3])                  # the whole arena, then unpinned: a may read it all
        a.begin_token()
        with pytest.raises(SlotsBusy):
            b.fetch(1, [0])                       # a victim would wait for a's next request
        assert srv.store.reuse.viewers[b.client_id].synced == float("inf")
        before = srv.stats.fetches
        ex = b.fetch(0, [2])                      # resident, yet through the daemon: b's window is shut
        assert srv.stats.fetches == before + 1 and bytes(ex[0].memory()) == bytes(a.fetch(0, [2])[0].memory())
        a.begin_token()                           # a's next request: the slot waiting for it is free
        assert b.fetch(1, [0])[0].layer == 1


def test_bogus_reports_cannot_keep_another_clients_misses_from_completing(server):  # noqa: F811
    """A client that reports every slot of the arena as read (keys it never saw there,
    keys that left long ago) and counts it never saw or that never move on, between
    every fetch of an honest client: its reports are refused and counted, it is dropped
    once it has held evicted slots back for a lease, and the honest client's misses all
    complete with the right bytes, in an arena of 4 slots."""
    srv = server(slots=4, lease_s=1.0)
    liar = raw_dealer(srv.cfg.endpoint)
    assert ask(liar, pack({"v": PROTOCOL_VERSION, "op": "hello", "id": 1, "name": "liar", "hit_path": True}))["ok"]
    assert ask(liar, pack({"v": PROTOCOL_VERSION, "op": "begin_token", "id": 2}))["ok"]   # synced: it saw all
    rid = 3
    with k3client.connect(srv.cfg.endpoint, name="honest") as c:
        want = {}
        for i in range(24):
            c.begin_token()
            layer, e = i % 4, (i * 5) % 16
            ex = c.fetch(layer, [e])[0]                     # a miss, most of the time
            want.setdefault((layer, e), bytes(ex.memory()))
            assert bytes(ex.memory()) == want[(layer, e)]
            bogus = [[layer2, [e2], [s]] for s in range(4) for layer2, e2 in [((i + s) % 4, s)]]
            liar.send(pack({"v": PROTOCOL_VERSION, "op": "hits", "id": rid, "hits": bogus,
                            "seen": 10 ** 9 if i % 2 else 0}))
            rid += 1
        st = c.status()
        assert st["stats"]["misses"] >= 12 and st["stats"]["bad_reports"] > 0
        assert [cl["name"] for cl in st["clients"]] == ["honest"] and st["stats"]["clients_dead"] == 1
    liar.close()
