"""Component: a fetch's inline reads through the real server loop (``FetchService``).

Small experts whose pages are cached are read on the loop thread; the misses,
the client's predictions and the daemon's own predictions that one fetch reads
that way are finished together before it is answered: all READY in the shared
index when the reply arrives, counted once.  A file found changed after those
reads fails the fetch in one line and leaves no slot of it READY; the daemon
serves what was resident on.
"""

import errno
import os
import threading

import pytest

import k3client
from helpers import expert_bytes, poll_for
from k3client.index import LOADING, READY
from k3d.demo.synthetic import write_checkpoint
from k3d.reads.inline import runs_of
from k3d.sources import base
from servers import Servers


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
    """2 layers x 8 experts of ~13 KB (read inline), one shard."""
    return write_checkpoint(str(tmp_path_factory.mktemp("small")), layers=2, experts=8, hidden=128, inter=64, seed=11)


def _cached(ckpt):
    """Every page of ``ckpt``'s files in the page cache: the inline path applies."""
    for path in os.listdir(ckpt):
        with open(os.path.join(ckpt, path), "rb") as f:
            while f.read(1 << 20):
                pass
    return ckpt


@pytest.fixture
def server(small_ckpt):
    servers = Servers(_cached(small_ckpt))
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


def test_inline_reads_cut_short_finish_whole_or_wait_for_the_pool(server, monkeypatch):
    """RWF_NOWAIT reads that stop part-way (a page not cached: a short count), through the
    stock read path.  Expert 2's rest then finds no page either (EAGAIN), so the pool reads
    it (held here); expert 3's rest arrives on the second try.  Meanwhile experts 1 and 3,
    read inline by the same fetch, are READY (another client answers them from the index,
    whole), expert 2 is LOADING there and the fetch waits for it; released, all are whole."""
    srv = server(slots=16, predict="off")
    firsts = {}                                # (fd, offset) of a run read first -> its length
    for e in (2, 3):
        f, off, _, size = runs_of(srv.source.keys[(0, e)])[1][0]
        firsts[srv.source.fds[f], off] = size
    (fd2, off2), size2 = next(iter(firsts.items()))
    rest2 = (fd2, off2 + size2 // 2)
    real, release, short = os.preadv, threading.Event(), []

    def preadv(fd, buffers, offset, flags=0):
        if not flags:                          # the pool's read (expert 2's only) is held
            release.wait(30)
            return real(fd, buffers, offset)
        n = firsts.get((fd, offset))
        if n is not None:
            short.append(offset)
            return real(fd, [buffers[0][:n // 2]], offset, flags)
        if (fd, offset) == rest2:
            raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
        return real(fd, buffers, offset, flags)

    monkeypatch.setattr(os, "preadv", preadv)
    got = {}
    with k3client.connect(srv.cfg.endpoint, name="a") as c, k3client.connect(srv.cfg.endpoint, name="b") as c2:
        t = threading.Thread(target=lambda: got.update(e=c.fetch(0, [1, 2, 3])), daemon=True)
        try:
            t.start()
            index = c2._hits.index
            states = poll_for(lambda: (s := [w & 3 for w in index.lookup(0, [1, 2, 3])])[0] == s[2] == READY and s,
                              what="the fetch's inline reads finished")
            assert states == [READY, LOADING, READY] and srv.reads.in_flight() == 1
            assert len(short) == 2 and (srv.reads.inline.done, srv.reads.inline.declined) == (2, 1)
            _same(srv, c2.fetch(0, [1, 3]))       # answered from the index: read whole
            assert t.is_alive()                   # the fetch waits for expert 2
        finally:
            release.set()
            t.join(30)
        _same(srv, got["e"])
        assert srv.reads.in_flight() == 0 and srv.stats.errors == 0


def test_a_change_under_one_files_inline_reads_spares_the_others(tmp_path, monkeypatch):
    """Two shards: shard 1 is written in place while the fetch's misses (layer 0) are
    read inline; its prediction (layer 1, shard 2) is read in the same pass.  The fetch
    fails in one line; the prediction is READY, whole, and used by the next fetch; layer 1
    serves on, layer 0's misses are refused, and the store's counts agree."""
    ckpt = write_checkpoint(str(tmp_path / "two"), layers=2, experts=8, hidden=128, inter=64, shards=2, seed=5)
    servers = Servers(_cached(ckpt))
    try:
        srv = servers.start(slots=16, predict="client")
        shard1 = srv.source.files[0]
        real, armed = base.read_fully, []

        def write_during_read(fd, buffers, offset, what, flags=0):
            n = real(fd, buffers, offset, what, flags)
            if armed and fd == srv.source.fds[0]:
                armed.clear()
                st = os.stat(shard1)
                os.utime(shard1, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
            return n

        with k3client.connect(srv.cfg.endpoint, name="c") as c:
            _same(srv, c.fetch(0, [0]))
            monkeypatch.setattr(base, "read_fully", write_during_read)
            armed.append(True)
            with pytest.raises(k3client.ReadFailed, match=f"source file {shard1} changed while served") as ei:
                c.fetch(0, [1, 2], predicted=[(1, 3)])
            assert "\n" not in str(ei.value)
            assert srv.reads.inline.done == 4 and srv.reads.in_flight() == 0
            assert not {(0, 1), (0, 2)} & srv.store.key_slot.keys()
            misses = srv.stats.misses
            _same(srv, c.fetch(1, [3]))           # the prediction: READY, whole (the daemon
            assert srv.stats.misses == misses     # answers: a failure keeps the window shut)
            _same(srv, c.fetch(1, [4, 5]))        # shard 2 serves on
            _same(srv, c.fetch(0, [0]))           # read whole before the change
            with pytest.raises(k3client.ReadFailed, match="changed while served"):
                c.fetch(0, [6])
            st = c.status()["stats"]
            assert (st["errors"], st["prefetched"], st["prefetch_hits"]) == (2, 1, 1)
            # the two failed reads moved the count clients read (``seen``) as reuse's
            assert c._hits.index.retired() == srv.store.reuse.retired == 2
    finally:
        servers.close()


def test_a_failure_after_inline_reads_leaves_none_of_them_loading(server, monkeypatch):
    """An error raised in a fetch after its misses and predictions were read inline (here
    injected into the daemon's own prediction step, which runs after the client's
    predictions were read: a bug there) fails that fetch alone, in one line: the reads
    are finished all the same, READY and whole, none left LOADING.  (Injected through
    the ``auto`` field, not by replacing a method: the compiled build's FetchService
    takes no new attribute, ``k3d.compiled``.)"""
    srv = server(slots=16, predict="client")

    class Failing:
        def idle(self, client: int) -> bool:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(srv.cache, "auto", Failing())
    with k3client.connect(srv.cfg.endpoint, name="d") as c:
        with pytest.raises(k3client.K3Error, match="internal error in k3d: OSError") as ei:
            c.fetch(0, [1, 2], predicted=[(1, 3)])
        assert "\n" not in str(ei.value)
        assert srv.reads.inline.done == 3 and srv.reads.in_flight() == 0
        assert [w & 3 for w in c._hits.index.lookup(0, [1, 2]) + c._hits.index.lookup(1, [3])] == [READY] * 3
        monkeypatch.undo()
        _same(srv, c.fetch(0, [1, 2]))
        _same(srv, c.fetch(1, [3]))
        st = c.status()["stats"]              # (after the reports of hits answered here)
        assert (st["misses"], st["prefetch_hits"], st["errors"]) == (2, 1, 0)
