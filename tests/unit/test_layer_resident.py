"""``LocalHits.layer_resident``: the hint that skips the vLLM plugin's gate-ahead router when
every expert of the next layer is resident, over a real ``SharedIndex`` memfd."""

from k3client.hits import LocalHits
from k3d.memory.index import SharedIndex

LAYERS, EXPERTS = 3, 4


def test_layer_resident_follows_the_index_and_its_retired_count():
    index = SharedIndex(LAYERS, EXPERTS)
    hits = LocalHits(index.fd, index.size, None)
    try:
        assert not hits.layer_resident(1, EXPERTS)                  # nothing resident
        for e in range(EXPERTS - 1):
            index.ready((1, e), e)
        assert not hits.layer_resident(1, EXPERTS)                  # one missing
        index.loading((1, EXPERTS - 1), 7)                          # being read counts: nothing to predict
        assert hits.layer_resident(1, EXPERTS)
        assert not hits.layer_resident(0, EXPERTS)                  # per layer
        index.clear((1, 2))                                         # an unpublish bumps retired
        assert not hits.layer_resident(1, EXPERTS)
        index.ready((1, 2), 2)
        assert hits.layer_resident(1, EXPERTS)
        index.clear((2, 0))                                         # another layer's clear: rescanned, still true
        assert hits.layer_resident(1, EXPERTS)
    finally:
        hits.close()
        index.close()


def test_the_lease_threads_count_goes_every_beat_and_reports_never_fall_behind_it():
    """``sync`` sends ``seen`` every beat, even unchanged (one the daemon could not apply,
    over its intake cap, comes again), and reports taken for a message that never left go
    first with it (a KeyboardInterrupt between ``take`` and the send)."""
    index = SharedIndex(1, 4)
    try:
        index.loading((0, 0), 0)
        index.ready((0, 0), 0)
        index.loading((0, 1), 1)
        index.clear((0, 1))
        h = LocalHits(index.fd, index.size, None)
        assert h.sync() == {"seen": 1} and h.sync() == {"seen": 1}
        h.sent()
        assert h.answer(0, [0]) == [0]
        h.open = False
        assert h.take()["hits"]                # the client's thread, then interrupted
        out = h.sync()                         # the lease thread first
        assert out == {"hits": [[0, [0], [0]]], "seen": 1}
        h.sent()
        h.failed()                             # nothing left to put back: it went
        assert h.reports == [] and h.take() == {}
        h.close()
    finally:
        index.close()
