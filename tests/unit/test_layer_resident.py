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
