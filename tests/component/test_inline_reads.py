"""Component: inline reads (``k3d.reads.inline``) with a real pool, arena and safetensors source.

A small expert whose pages are cached is read by ``Loads.start`` itself (no load
in the books nor a report: its slot waits for ``take_inline``, the bytes in it); one whose pages
are not cached, one past the call's budget, and any read of a source whose
``read`` is not the stock one go to the reader pool and finish there.
"""

import os
from dataclasses import replace

from helpers import finished_loads, source_image
from k3d.config import DEFAULT_PATTERN
from k3d.demo.synthetic import write_checkpoint
from k3d.memory.arena import Arena
from k3d.reads.inline import NOWAIT, can_inline, runs_of
from k3d.reads.loads import Loads
from k3d.sources import base
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
        assert loads.start([(5, keys[0]), (1, keys[1]), (2, keys[2])], urgent=True, owner=4) == []
        assert loads.in_flight() == 0 and loads.queued() == (0, 0) and not loads.has_reports()
        done = loads.take_inline()
        assert done.slots == [5, 1, 2] and done.keys == keys and loads.take_inline() is None
        assert done.nbytes == sum(e.length for k in keys for e in src.keys[k]) and done.seconds > 0
        assert loads.inline.done == 3 and loads.inline.declined == 0
        for slot, key in zip(done.slots, done.keys):
            assert bytes(arena.view(slot)[:src.expert_bytes]) == source_image(src, key)
    finally:
        _close(src, arena, loads)


def test_uncached_and_over_budget_reads_go_to_the_pool(tmp_path):
    src, arena, loads = _setup(tmp_path)
    try:
        keys = sorted(src.keys)
        _cache(src, cached=False)
        cold = loads.start([(0, keys[0])], urgent=True, owner=1)[0]
        assert loads.in_flight() == 1 and loads.take_inline() is None     # the page was not cached
        assert loads.inline.declined == 1
        assert finished_loads(loads, 1) == [cold]
        _cache(src, cached=True)
        loads.inline.budget = 2 * src.expert_bytes                  # room for two in one call
        started = loads.start([(1, keys[1]), (2, keys[2]), (3, keys[3])], urgent=False)
        assert [ld.key for ld in started] == [keys[3]] and loads.in_flight() == 1
        assert loads.take_inline().keys == [keys[1], keys[2]]
        assert set(finished_loads(loads, 1)) == set(started)
        for ld in [cold, *started]:
            assert ld.fail is None
        for slot in range(4):
            assert bytes(arena.view(slot)[:src.expert_bytes]) == source_image(src, keys[slot])
    finally:
        _close(src, arena, loads)


def test_an_expert_in_several_runs_is_read_whole(tmp_path):
    """Extents contiguous in the file but not in the slot are separate runs (one
    ``preadv`` each), each into its own part of the slot."""
    src, arena, loads = _setup(tmp_path)
    try:
        _cache(src, cached=True)
        key = sorted(src.keys)[0]
        e0, e1, *rest = src.keys[key]
        src.keys[key] = [replace(e0, slot_offset=e1.length), replace(e1, slot_offset=0), *rest]
        assert len(runs_of(src.keys[key])[1]) == 3
        arena.view(0)[:] = b"\xff" * arena.slot_bytes
        assert loads.start([(0, key)], urgent=True) == [] and loads.take_inline().slots == [0]
        fd = os.open(src.files[0], os.O_RDONLY)
        try:
            for e in src.keys[key]:
                assert bytes(arena.view(0)[e.slot_offset:e.slot_offset + e.length]) == os.pread(fd, e.length, e.offset)
        finally:
            os.close(fd)
    finally:
        _close(src, arena, loads)


def test_an_expert_cached_in_part_is_read_whole_either_way(tmp_path):
    """A page not cached part-way through an expert gives a short count; the attempt
    then finishes through the pread loop (the kernel may have read the page meanwhile:
    read-ahead started by the first attempt) or goes to the pool, which reads the
    whole expert.  Either way the slot ends with the expert's bytes, finished once."""
    src, arena, loads = _setup(tmp_path)
    try:
        _cache(src, cached=False)
        key = sorted(src.keys)[0]
        first = min(e.offset for e in src.keys[key])
        fd = os.open(src.files[0], os.O_RDONLY)
        try:          # only the expert's first page cached (no read-ahead: FADV_RANDOM)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            os.pread(fd, 4096, first // 4096 * 4096)
        finally:
            os.close(fd)
        arena.view(3)[:] = b"\xff" * arena.slot_bytes
        pooled = loads.start([(3, key)], urgent=True, owner=2)
        inline = loads.take_inline()
        assert loads.inline.done + loads.inline.declined == 1
        if pooled:
            assert inline is None and loads.inline.declined == 1
            assert finished_loads(loads, 1) == pooled and pooled[0].fail is None
        else:
            assert inline.slots == [3] and loads.in_flight() == 0
        assert bytes(arena.view(3)[:src.expert_bytes]) == source_image(src, key)
    finally:
        _close(src, arena, loads)


def test_a_replaced_read_fully_sees_every_inline_read(tmp_path, monkeypatch):
    """Fault injection that replaces ``base.read_fully`` reaches inline reads too: every
    run goes through it (here it fails the first key once, which the pool then reads)."""
    src, arena, loads = _setup(tmp_path)
    calls = []
    real = base.read_fully

    def injected(fd, buffers, offset, what, flags=0):
        calls.append(flags)
        if len(calls) == 1:
            raise OSError(5, f"{what}: Input/output error")
        return real(fd, buffers, offset, what, flags)

    monkeypatch.setattr(base, "read_fully", injected)
    try:
        _cache(src, cached=True)
        keys = sorted(src.keys)[:2]
        pooled = loads.start([(0, keys[0]), (1, keys[1])], urgent=True, owner=1)
        assert [ld.key for ld in pooled] == [keys[0]] and loads.take_inline().slots == [1]
        assert calls[:2] == [NOWAIT, NOWAIT] and loads.inline.declined == 1
        assert finished_loads(loads, 1)[0].fail is None and len(calls) >= 3    # the pool's read: through it too
        for slot, key in enumerate(keys):
            assert bytes(arena.view(slot)[:src.expert_bytes]) == source_image(src, key)
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
