"""Component: ``reads.loads`` with a real reader pool, arena and safetensors source.

The load token: every read gets its own id (not its slot: a slot read twice
gets two tokens), its parts report under it, and the load leaves the books
only when its last part reported, with the bytes in its slot.
"""


from helpers import finished_loads, source_image
from k3d.config import DEFAULT_PATTERN
from k3d.memory.arena import Arena
from k3d.reads.loads import Loads
from k3d.sources.safetensors import SafetensorsSource


def test_tokens_are_per_read_not_per_slot(checkpoint):
    src = SafetensorsSource(checkpoint, DEFAULT_PATTERN)
    arena = Arena(4, src.expert_bytes + (-src.expert_bytes) % 4096)
    loads = Loads(4, src, arena)
    try:
        keys = sorted(src.keys)[:3]
        started = loads.start([(2, keys[0]), (0, keys[1])], urgent=True, owner=7)
        assert [ld.slot for ld in started] == [2, 0] and len({ld.id for ld in started}) == 2
        assert all(ld.parts_left >= 1 for ld in started) and loads.in_flight() == 2
        done = finished_loads(loads, 2)
        assert {ld.id for ld in done} == {ld.id for ld in started}
        assert all(ld.fail is None and ld.parts_left == 0 for ld in done) and loads.in_flight() == 0
        for ld in started:
            assert bytes(arena.view(ld.slot)[:src.expert_bytes]) == source_image(src, ld.key)
        again = loads.start([(2, keys[2])], urgent=False)[0]          # slot 2 read again
        assert again.slot == 2 and again.id not in {ld.id for ld in started}
        assert finished_loads(loads, 1)[0] is again
        assert bytes(arena.view(2)[:src.expert_bytes]) == source_image(src, keys[2])
    finally:
        assert loads.cancel_all()
        arena.close()
        src.close()


def test_cancel_all_reports_every_queued_part_under_its_token(checkpoint):
    src = SafetensorsSource(checkpoint, DEFAULT_PATTERN)
    arena = Arena(8, src.expert_bytes + (-src.expert_bytes) % 4096)
    loads = Loads(1, src, arena)
    try:
        keys = sorted(src.keys)[:8]
        started = loads.start(list(enumerate(keys)), urgent=False)
        assert loads.cancel_all()
        done = []
        for _, ld in loads.reported():
            if ld is not None:
                done.append(ld)
        assert {ld.id for ld in done} == {ld.id for ld in started} and loads.in_flight() == 0
        cancelled = [ld for ld in done if ld.fail]
        assert all("cancelled" in ld.fail for ld in cancelled)
    finally:
        arena.close()
        src.close()
