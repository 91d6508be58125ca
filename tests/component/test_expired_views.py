"""Component: an ``Expert`` whose pin has ended builds no view, against the real server loop.

A view is valid until the client's next ``begin_token()``, ``close()`` or release of its
layer.  The client enforces the half it can: an ``Expert`` fetched before one of those
refuses (``k3client.Expired``) instead of building a view of a slot that may hold
another expert by then.  Shown where it matters, with a second client's misses taking
the slots between:

- after ``begin_token()`` (waited or not), every earlier ``Expert`` refuses, whether the
  daemon or the shared index answered it, while the bytes a refetch gives are right;
- after ``release_layer(L)`` the layer's earlier ``Expert``s refuse, other layers' and a
  later fetch of ``L`` build views;
- a ``fetch_iter`` answered from the shared index, interrupted by ``begin_token()``,
  yields ``Expert``s that refuse;
- ``close()`` refuses too (as ``DaemonRestarted`` did before: no arena).
"""

import pytest
from test_server_component import reference, server  # noqa: F401 -- the fixture, and its helper

import k3client


def test_begin_token_expires_every_earlier_expert(server):  # noqa: F811
    srv = server(slots=4, predict="off")
    with k3client.connect(srv.cfg.endpoint, name="a") as a, k3client.connect(srv.cfg.endpoint, name="b") as b:
        first = a.fetch(0, [0, 1])               # misses: the daemon answers
        again = a.fetch(0, [0, 1])               # hits: the shared index answers (the hit path)
        name = a.layout_of(0)[0].name
        a.begin_token(wait=False)                # not waited for: refused all the same
        for e in (*first, *again):
            with pytest.raises(k3client.Expired, match=r"before this client's begin_token\(\)"):
                e.memory()
            with pytest.raises(k3client.Expired):
                e.array(name)
        a.begin_token()                          # waited
        got = b.fetch(1, [0, 1, 2, 3])           # b's misses take every slot, a's old ones too
        assert {e.slot for e in first} <= {e.slot for e in got}
        for e in first:                          # what a view built now would have shown
            assert bytes(got[[x.slot for x in got].index(e.slot)].memory()) != reference(srv, (0, e.expert))
            with pytest.raises(k3client.Expired):
                e.memory()
        b.begin_token()
        now = a.fetch(0, [0, 1])                 # a refetch reads them again
        assert [bytes(e.memory()) for e in now] == [reference(srv, (0, x)) for x in (0, 1)]


def test_release_layer_expires_that_layers_experts_only(server):  # noqa: F811
    srv = server(slots=8, predict="off")
    with k3client.connect(srv.cfg.endpoint, name="a") as a:
        l0, l1 = a.fetch(0, [0, 1]), a.fetch(1, [2])
        a.release_layer(0)
        for e in l0:
            with pytest.raises(k3client.Expired, match=r"release_layer\(0\)"):
                e.memory()
        assert bytes(l1[0].memory()) == reference(srv, (1, 2))     # another layer: still pinned
        later = a.fetch(0, [1])                                    # fetched again: pinned afresh
        assert bytes(later[0].memory()) == reference(srv, (0, 1))


def test_a_local_fetch_iter_interrupted_by_begin_token_yields_expired_experts(server):  # noqa: F811
    srv = server(slots=8, predict="off")
    with k3client.connect(srv.cfg.endpoint, name="a") as a:
        a.fetch(0, [0, 1, 2])
        a.begin_token()
        it = a.fetch_iter(0, [0, 1, 2])          # all resident: answered from the shared index
        i, first = next(it)
        assert bytes(first.memory()) == reference(srv, (0, 0))
        a.begin_token()
        rest = list(it)
        assert [i for i, _ in rest] == [1, 2]
        for _, e in rest:
            with pytest.raises(k3client.Expired):
                e.memory()


def test_close_refuses_views(server):  # noqa: F811
    srv = server(slots=4, predict="off")
    a = k3client.connect(srv.cfg.endpoint, name="a")
    got = a.fetch(0, [0])
    a.close()
    with pytest.raises((k3client.Expired, k3client.DaemonRestarted)):
        got[0].memory()
