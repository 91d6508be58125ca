"""Component: a fetch's inline reads through the real server loop (``FetchService``).

Small experts whose pages are cached are read on the loop thread; the misses,
the client's predictions and the daemon's own predictions that one fetch reads
that way are finished together before it is answered: all READY in the shared
index when the reply arrives, counted once.  A file found changed after those
reads fails the fetch in one line and leaves no slot of it READY; the daemon
serves what was resident on.
"""

import os

import pytest

import k3client
from helpers import expert_bytes
from k3d.demo.synthetic import write_checkpoint
from k3d.sources import base
from servers import Servers


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
    """2 layers x 8 experts of ~13 KB (read inline), one shard."""
    return write_checkpoint(str(tmp_path_factory.mktemp("small")), layers=2, experts=8, hidden=128, inter=64, seed=11)


@pytest.fixture
def server(small_ckpt):
    for path in os.listdir(small_ckpt):          # every page cached: the inline path applies
        with open(os.path.join(small_ckpt, path), "rb") as f:
            while f.read(1 << 20):
                pass
    servers = Servers(small_ckpt)
    yield servers.start
    servers.close()


def _same(srv, experts):
    for e in experts:
        assert bytes(e.memory()) == expert_bytes(srv.ref, srv.source.layout, (e.layer, e.expert))


def test_a_fetch_and_its_predictions_are_ready_when_it_is_answered(server):
    srv = server(slots=16, predict="client")
    with k3client.connect(srv.cfg.endpoint, name="a") as c:
        assert c.hit_path == "client"
        _same(srv, c.fetch(0, [1, 2, 3], predicted=[(1, 4), (1, 5)]))
        st = c.status()["stats"]
        assert (st["misses"], st["prefetched"]) == (3, 2)
        assert st["bytes_read"] == 5 * srv.source.expert_bytes
        assert srv.reads.inline.done == 5 and srv.reads.in_flight() == 0
        # the predictions were READY in the index with the reply: answered here, no request
        fetches = srv.stats.fetches
        _same(srv, c.fetch(1, [4, 5]))
        assert srv.stats.fetches == fetches


def test_a_file_changed_under_inline_reads_fails_that_fetch_alone(server, monkeypatch):
    srv = server(slots=16, predict="client")
    shard = srv.source.files[0]
    real, armed = base.read_fully, []

    def write_during_read(fd, buffers, offset, what, flags=0):
        n = real(fd, buffers, offset, what, flags)
        if armed and armed.pop():
            st = os.stat(shard)            # a write in place moves mtime (k3d.sources.identity)
            os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        return n

    with k3client.connect(srv.cfg.endpoint, name="b") as c:
        _same(srv, c.fetch(0, [0, 1]))
        monkeypatch.setattr(base, "read_fully", write_during_read)   # inline reads go through it too
        armed.append(True)
        with pytest.raises(k3client.ReadFailed, match="changed while served") as ei:
            c.fetch(0, [2, 3], predicted=[(1, 6)])
        assert "\n" not in str(ei.value)
        assert srv.reads.in_flight() == 0
        assert not {(0, 2), (0, 3), (1, 6)} & srv.store.key_slot.keys()     # none of them served
        assert c.status()["stats"]["errors"] == 3
        c.begin_token()
        _same(srv, c.fetch(0, [0, 1]))                  # read whole before the change: still served
        with pytest.raises(k3client.ReadFailed, match="changed while served"):
            c.fetch(0, [4])                             # a read from the changed file: refused at once
