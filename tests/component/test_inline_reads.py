"""Component: inline reads (``k3d.reads.inline``) with a real pool, arena and safetensors source.

A small expert whose pages are cached is read by ``Loads.start`` itself (no load
in the books, its report ready at once, the bytes in its slot); one whose pages
are not cached, one past the call's budget, and any read of a source whose
``read`` is not the stock one go to the reader pool and finish there.
"""

import os

from helpers import finished_loads, source_image
from k3d.config import DEFAULT_PATTERN
from k3d.demo.synthetic import write_checkpoint
from k3d.memory.arena import Arena
from k3d.reads.inline import can_inline
from k3d.reads.loads import Loads
from k3d.sources.safetensors import SafetensorsSource


def _ckpt(tmp_path):
    return write_checkpoint(str(tmp_path / "ckpt"), layers=2, experts=8, hidden=256, inter=128, seed=3)


def _cache(src, cached: bool):
    """Put every shard in the page cache, or take it out (clean pages: DONTNEED drops them)."""
    for path in src.files:
        fd = os.open(path, os.O_RDONLY)
        try:
            if cached:
                while os.read(fd, 1 << 20):
                    pass
            else:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _setup(tmp_path, src_cls=SafetensorsSource):
    src = src_cls(_ckpt(tmp_path), DEFAULT_PATTERN)
    arena = Arena(8, src.expert_bytes + (-src.expert_bytes) % 4096)
    return src, arena, Loads(2, src, arena, inline=True)


def _close(src, arena, loads):
    assert loads.cancel_all()
    arena.close()
    src.close()


def test_cached_small_experts_are_read_in_start(tmp_path):
    src, arena, loads = _setup(tmp_path)
    try:
        _cache(src, cached=True)
        keys = sorted(src.keys)[:3]
        started = loads.start([(5, keys[0]), (1, keys[1]), (2, keys[2])], urgent=True, owner=4)
        assert loads.in_flight() == 0 and loads.queued() == (0, 0) and loads.has_inline()
        done = list(loads.reported())
        assert [ld for _, ld in done] == started and not loads.has_reports()
        assert all(d.error is None and d.owner == 4 and d.nbytes == sum(e.length for e in src.keys[ld.key])
                   for d, ld in done)
        for ld in started:
            assert bytes(arena.view(ld.slot)[:src.expert_bytes]) == source_image(src, ld.key)
    finally:
        _close(src, arena, loads)


def test_uncached_and_over_budget_reads_go_to_the_pool(tmp_path):
    src, arena, loads = _setup(tmp_path)
    try:
        keys = sorted(src.keys)
        _cache(src, cached=False)
        cold = loads.start([(0, keys[0])], urgent=True, owner=1)[0]
        assert loads.in_flight() == 1 and not loads.has_inline()     # the page was not cached
        assert finished_loads(loads, 1) == [cold]
        _cache(src, cached=True)
        loads.inline.budget = 2 * src.expert_bytes                  # room for two in one call
        started = loads.start([(1, keys[1]), (2, keys[2]), (3, keys[3])], urgent=False)
        assert loads.in_flight() == 1 and loads.has_inline()
        assert set(finished_loads(loads, 3)) == set(started)
        for ld in [cold, *started]:
            assert ld.fail is None
            assert bytes(arena.view(ld.slot)[:src.expert_bytes]) == source_image(src, ld.key)
    finally:
        _close(src, arena, loads)


class WrappedRead(SafetensorsSource):
    reads = 0

    def read(self, extents, slot):
        WrappedRead.reads += 1
        return super().read(extents, slot)


def test_a_replaced_read_is_never_bypassed(tmp_path):
    src, arena, loads = _setup(tmp_path, WrappedRead)
    try:
        assert not can_inline(src) and not loads.inline.max_bytes
        _cache(src, cached=True)
        key = sorted(src.keys)[0]
        ld = loads.start([(0, key)], urgent=True, owner=1)[0]
        assert finished_loads(loads, 1) == [ld] and WrappedRead.reads >= 1
        assert bytes(arena.view(0)[:src.expert_bytes]) == source_image(src, key)
    finally:
        _close(src, arena, loads)
