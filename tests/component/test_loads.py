"""Component: ``reads.loads`` with a real reader pool, arena and safetensors source.

The load token: every read gets its own id (not its slot: a slot read twice
gets two tokens), its parts report under it, and the load leaves the books
only when its last part reported, with the bytes in its slot.
"""

import time

from k3d.config import DEFAULT_PATTERN
from k3d.memory.arena import Arena
from k3d.reads.loads import Loads
from k3d.sources.safetensors import SafetensorsSource


def finish(loads, n, timeout=10):
    """Poll the pool's reports until ``n`` loads have finished; returns them in finishing order."""
    out, deadline = [], time.monotonic() + timeout
    while len(out) < n:
        assert time.monotonic() < deadline, f"{len(out)} of {n} loads finished"
        out.extend(load for _, load in loads.reported() if load is not None)
        time.sleep(0.005)
    return out


def reference(src, key):
    buf = bytearray(src.expert_bytes)
    SafetensorsSource.read(src, src.keys[key], memoryview(buf))
    return bytes(buf)


def test_tokens_are_per_read_not_per_slot(checkpoint):
    src = SafetensorsSource(checkpoint, DEFAULT_PATTERN)
    arena = Arena(4, src.expert_bytes + (-src.expert_bytes) % 4096)
    loads = Loads(4, src, arena)
    try:
        keys = sorted(src.keys)[:3]
        started = loads.start([(2, keys[0]), (0, keys[1])], urgent=True, owner=7)
        assert [ld.slot for ld in started] == [2, 0] and len({ld.id for ld in started}) == 2
        assert all(ld.parts_left >= 1 for ld in started) and loads.in_flight() == 2
        done = finish(loads, 2)
        assert {ld.id for ld in done} == {ld.id for ld in started}
        assert all(ld.fail is None and ld.parts_left == 0 for ld in done) and loads.in_flight() == 0
        for ld in started:
            assert bytes(arena.view(ld.slot)[:src.expert_bytes]) == reference(src, ld.key)
        again = loads.start([(2, keys[2])], urgent=False)[0]          # slot 2 read again
        assert again.slot == 2 and again.id not in {ld.id for ld in started}
        assert finish(loads, 1)[0] is again
        assert bytes(arena.view(2)[:src.expert_bytes]) == reference(src, keys[2])
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
