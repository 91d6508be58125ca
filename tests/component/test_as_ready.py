"""Component: fetches answered as their experts become ready, against the real server loop.

- on the wire (protocol 5): a ``fetch`` with ``as_ready`` that waits for reads sends
  the keys ready now as a part, then each read as it finishes, then the unchanged
  final reply; one ready at once sends only the final reply; every key of a part
  is pinned; a client that began a new token gets no more parts;
- ``Client.fetch_iter``: the resident experts come first while a read is held,
  the others as their reads finish, each once, with the right bytes;
- leaving the loop, an exception in it, or a timeout mid-stream keeps the hit path
  shut until the next request, and what was yielded stays valid (pinned);
- another request of the client ends the iteration with a one-line error;
- a daemon replaced mid-stream: the client re-attaches and asks for the rest only.

A read is held by a gate (``hold``): the reader blocks on it until the test lets it
go, so what arrives before the read finished is known without timing.
"""

import os
import shutil
import tempfile
import threading

import pytest
from test_server_component import Faulty, raw_dealer, server  # noqa: F401 -- the fixture, and its helpers

import k3client
from conftest import SCRATCH
from helpers import expert_bytes, poll_for, verify
from k3client import errors
from k3client.protocol import PROTOCOL_VERSION, pack, unpack
from servers import Servers


def hold(srv, *keys):
    """Block the reads of ``keys`` until the returned events are set (one per key)."""
    src = srv.source
    gates = {k: threading.Event() for k in keys}
    started = set()
    read = src.read

    def gated(extents, slot):
        key = src.key_of(extents[0])
        if key in gates:
            started.add(key)
            gates[key].wait(30)
        return read(extents, slot)

    src.read = gated
    src.held_started = started
    return [gates[k] for k in keys]


def request(s, rid, op, **fields):
    s.send(pack({"v": PROTOCOL_VERSION, "op": op, "id": rid, **fields}))


def reply(s):
    assert s.poll(10_000), "no reply within 10 s"
    return unpack(s.recv())


def test_parts_come_as_reads_finish_then_the_final_reply(server):  # noqa: F811
    srv = server()
    s = raw_dealer(srv.cfg.endpoint)
    request(s, 1, "hello", name="raw")
    assert reply(s)["ok"]
    request(s, 2, "fetch", keys=[[0, 1]])            # resident from here on
    resident = reply(s)["slots"][0]
    request(s, 3, "begin_token")
    assert reply(s)["ok"]
    g6, g7 = hold(srv, (0, 6), (0, 7))
    request(s, 4, "fetch", keys=[[0, 6], [0, 1], [0, 7]], as_ready=True)
    first = reply(s)
    assert first["id"] == 4 and first["part"] == [1] and first["slots"] == [resident]
    poll_for(lambda: srv.source.held_started == {(0, 6), (0, 7)}, 10, "both held reads to start")
    with k3client.connect(srv.cfg.endpoint, name="obs", hit_path="daemon") as o:
        raw = next(c for c in o.status()["clients"] if c["name"] == "raw")
    assert raw["pins"] == 3                          # every key of the fetch, ready or not
    g7.set()
    second = reply(s)
    assert second["part"] == [2] and len(second["slots"]) == 1
    g6.set()
    final = reply(s)
    assert final["ok"] and "part" not in final
    assert final["slots"][1:] == [resident, second["slots"][0]]
    assert srv.stats.fetches == 2                    # parts count as one fetch
    s.close()


def test_a_fetch_ready_at_once_gets_only_the_final_reply(server):  # noqa: F811
    srv = server()
    s = raw_dealer(srv.cfg.endpoint)
    request(s, 1, "hello", name="raw")
    assert reply(s)["ok"]
    request(s, 2, "fetch", keys=[[1, 1], [1, 2]])
    slots = reply(s)["slots"]
    request(s, 3, "fetch", keys=[[1, 2], [1, 1]], as_ready=True)
    r = reply(s)
    assert "part" not in r and r["slots"] == slots[::-1]
    request(s, 4, "fetch", keys=[[1, 3]], as_ready="yes")
    r = reply(s)
    assert r["ok"] is False and r["error"]["code"] == "bad_request" and "as_ready" in r["error"]["message"]
    s.close()


def test_a_client_on_its_next_token_gets_no_more_parts(server):  # noqa: F811
    """A client that began a new token gave the stream up: the reads that finish after
    send nothing but the final reply (repinned for its new token, as for any fetch).
    Both reads are held until the new token is answered, so the order is known: no
    part can come first (nothing was ready), and any part would come before the
    final reply, which is sent once both reads are in."""
    srv = server()
    s = raw_dealer(srv.cfg.endpoint)
    request(s, 1, "hello", name="raw")
    assert reply(s)["ok"]
    g3, g4 = hold(srv, (2, 3), (2, 4))
    request(s, 2, "fetch", keys=[[2, 3], [2, 4]], as_ready=True)
    poll_for(lambda: srv.store.stats.misses == 2, 10, "the fetch to be planned")
    request(s, 3, "begin_token")
    begun = reply(s)
    assert begun["id"] == 3 and begun["ok"] and "part" not in begun
    g4.set()                                          # each read finishes after the new token
    g3.set()
    final = reply(s)
    assert final["id"] == 2 and final["ok"] and "part" not in final, final
    assert len(final["slots"]) == 2
    s.close()


def test_fetch_iter_yields_the_resident_experts_first(server):  # noqa: F811
    srv = server()
    with k3client.connect(srv.cfg.endpoint, name="it") as c:
        c.fetch(0, [1, 2])
        c.begin_token()
        (g,) = hold(srv, (0, 5))
        it = c.fetch_iter(0, [5, 1, 2])
        first = [next(it), next(it)]                  # while (0, 5)'s read is still held
        assert not g.is_set() and sorted(i for i, _ in first) == [1, 2]
        assert [(i, e.expert) for i, e in first] == [(i, [5, 1, 2][i]) for i, _ in first]
        verify(c, [e for _, e in first], srv.ref)
        g.set()
        rest = list(it)
        assert [(i, e.expert) for i, e in rest] == [(0, 5)]
        verify(c, [e for _, e in first + rest], srv.ref)
        before = srv.stats.fetches
        assert [e.slot for e in c.fetch(0, [2, 5])] == [first[1][1].slot if first[1][0] == 2
                                                         else first[0][1].slot, rest[0][1].slot]
        assert srv.stats.fetches == before            # the window opened with the final reply


def test_fetch_iter_without_the_hit_path(server):  # noqa: F811
    """``hit_path="daemon"``: every fetch_iter goes to the daemon; resident experts come in
    the final reply at once, in request order, and a read still comes after them."""
    srv = server()
    with k3client.connect(srv.cfg.endpoint, name="d", hit_path="daemon") as c:
        c.fetch(2, [4, 5])
        before = srv.stats.fetches
        assert [(i, e.expert) for i, e in c.fetch_iter(2, [5, 4])] == [(0, 5), (1, 4)]
        assert srv.stats.fetches == before + 1
        (g,) = hold(srv, (2, 0))
        it = c.fetch_iter(2, [0, 4])
        assert [(i, e.expert) for i, e in [next(it)]] == [(1, 4)] and not g.is_set()
        g.set()
        got = list(it)
        assert [(i, e.expert) for i, e in got] == [(0, 0)]
        verify(c, [e for _, e in got], srv.ref)


def test_fetch_iter_of_resident_experts_sends_nothing(server):  # noqa: F811
    srv = server()
    with k3client.connect(srv.cfg.endpoint, name="it") as c:
        c.fetch(3, [7, 8])
        before = srv.stats.fetches
        assert [(i, e.expert) for i, e in c.fetch_iter(3, [8, 7])] == [(0, 8), (1, 7)]
        assert srv.stats.fetches == before
        with pytest.raises(errors.BadRequest, match="integer"):
            c.fetch_iter(3, [1.5])                    # at the call, before any iteration


@pytest.mark.parametrize("how", ["break", "interrupt", "timeout"])
def test_an_interrupted_iteration_keeps_the_window_shut(server, how):  # noqa: F811
    """Mid-stream, the experts yielded stay valid (pinned) and the client answers nothing
    from the index until its next request succeeds."""
    srv = server()
    with k3client.connect(srv.cfg.endpoint, name="it", timeout=0.5 if how == "timeout" else 30) as c:
        c.fetch(1, [1, 2])
        c.begin_token()
        (g,) = hold(srv, (1, 9))
        got = []
        it = c.fetch_iter(1, [1, 9, 2])
        if how == "break":
            for _i, e in it:
                got.append(e)
                if len(got) == 2:
                    break
            it.close()                               # (what leaving a for loop does, once collected)
        elif how == "interrupt":
            with pytest.raises(KeyboardInterrupt):
                for _i, e in it:
                    got.append(e)
                    if len(got) == 2:
                        raise KeyboardInterrupt
        else:
            with pytest.raises(errors.Timeout):
                for _i, e in it:
                    got.append(e)
        assert sorted(e.expert for e in got) == [1, 2] and not g.is_set()
        assert c._hits.open is False
        before = srv.stats.fetches
        g.set()
        verify(c, got, srv.ref)                      # pinned: still their experts' bytes
        assert [e.expert for e in c.fetch(1, [2])] == [2]
        assert srv.stats.fetches == before + 1        # through the daemon: the window was shut
        assert c._hits.open is True
        c.fetch(1, [1])
        assert srv.stats.fetches == before + 1        # and open again after that reply


def test_another_request_ends_the_iteration(server):  # noqa: F811
    srv = server()
    with k3client.connect(srv.cfg.endpoint, name="it") as c:
        c.fetch(2, [1])
        c.begin_token()
        (g,) = hold(srv, (2, 9))
        it = c.fetch_iter(2, [1, 9])
        assert next(it)[0] == 0
        g.set()
        c.status()
        with pytest.raises(errors.K3Error, match="another request"):
            next(it)
        assert [e.expert for e in c.fetch(2, [9, 1])] == [9, 1]


def test_a_daemon_replaced_mid_stream_answers_the_rest(checkpoint):
    """The stream's daemon is replaced (a new one binds the endpoint) while a read it
    waits on is held: the client re-attaches and asks the new daemon for the experts
    not yet yielded only; the view taken before keeps the old arena's bytes."""
    tmp = tempfile.mkdtemp(prefix="k3d-c-", dir=SCRATCH)
    endpoint = f"ipc://{tmp}/k.sock"
    servers = Servers(checkpoint, Faulty)

    def start():
        return servers.start(endpoint)

    first = start()
    (g,) = hold(first, (3, 9))
    try:
        with k3client.connect(endpoint, name="it") as c:
            c.fetch(3, [1])
            c.begin_token()
            it = c.fetch_iter(3, [1, 9])
            i, ex = next(it)
            view = ex.memory()
            poll_for(lambda: first.source.held_started, 10, "the held read to start")
            os.unlink(f"{tmp}/k.sock.arena")           # (a restarted daemon finds its old one's gone)
            second = start()                           # binds the endpoint anew: the socket is replaced
            rest = list(it)
            assert i == 0 and [(j, e.expert) for j, e in rest] == [(1, 9)] and c.restarts == 1
            verify(c, [e for _, e in rest], second.ref)
            assert bytes(view) == expert_bytes(first.ref, first.source.layout, (3, 1))   # the old mapping
            with pytest.raises(errors.DaemonRestarted):
                ex.memory()                                # its slot names nothing in the new arena
            assert first.stats.misses == 2 and second.stats.misses == 1     # only (3, 9) asked again
    finally:
        g.set()
        servers.close()                                  # the first's stop unlinks the endpoint last
        shutil.rmtree(tmp, ignore_errors=True)
