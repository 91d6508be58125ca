"""The arena's registration as pinned host memory, against a stand-in of the CUDA calls.

No GPU here: ``FakeCuda`` (tests/fake_cuda.py) keeps the driver's rules (overlapping
ranges refused, registrations outliving munmap, a failed call's error pending until
drained).  The same code runs against ``torch.cuda.cudart()`` on a GPU host
(tests/integration/test_hf_gpu.py).
"""

import mmap
import warnings

import pytest
import torch
from hypothesis import given, strategies as st

from fake_cuda import FakeCuda
from k3client.gpu import pinning
from k3client.gpu.cuda import REGISTER_PORTABLE, REGISTER_READ_ONLY, describe

PAGE = 4096
CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)


@given(slots=st.integers(1, 300), slot_pages=st.integers(1, 64), tail_pages=st.integers(0, 600),
       limit_pages=st.integers(1, 5000))
def test_chunks_cover_the_arena_on_slot_boundaries(slots, slot_pages, tail_pages, limit_pages):
    slot_bytes, size, limit = slot_pages * PAGE, (slots * slot_pages + tail_pages) * PAGE, limit_pages * PAGE
    chunks = pinning.plan_chunks(size, slot_bytes, limit)
    assert chunks[0][0] == 0 and sum(n for _, n in chunks) == size
    for (a, n), (b, _) in zip(chunks, chunks[1:]):
        assert a + n == b and b % slot_bytes == 0, "a chunk ends inside a slot"
        assert n <= max(limit, slot_bytes)


def test_a_64_gib_limit_cuts_a_600_gib_arena_into_ten_calls():
    slot_bytes = 13_238_272                      # a gpt-oss-120b expert, 4096-aligned
    chunks = pinning.plan_chunks(48_000 * slot_bytes, slot_bytes)
    assert len(chunks) == 10 and all(n <= 64 << 30 and n % slot_bytes == 0 for _, n in chunks)


@pytest.fixture
def arena():
    mm = mmap.mmap(-1, 10 * PAGE, prot=mmap.PROT_READ)
    yield mm
    mm.close()


def test_registered_in_chunks_read_only_once_per_mapping_and_generation(arena, monkeypatch):
    monkeypatch.setattr(pinning, "CHUNK_LIMIT", 4 * PAGE)
    fake = FakeCuda()
    p = pinning.Pinning(lambda: fake)
    assert p.register(arena, 1, 2 * PAGE, {CUDA0})
    base = pinning.address_of(arena)
    regs = fake.of("register")
    assert [(a - base, n) for _, a, n, _, _ in regs] == [(0, 4 * PAGE), (4 * PAGE, 4 * PAGE), (8 * PAGE, 2 * PAGE)]
    assert all(flags == REGISTER_PORTABLE | REGISTER_READ_ONLY for *_, flags, _ in regs)
    assert fake.of("attribute 113") == [("attribute 113", 0)]
    assert p.register(arena, 1, 2 * PAGE, {CUDA0})          # the same mapping and generation: no call
    assert len(fake.of("register")) == 3
    assert p.registered[(id(arena), 1)].nbytes == len(arena)


def test_a_failed_registration_leaves_no_pending_error_and_names_it(arena, monkeypatch):
    monkeypatch.setattr(pinning, "CHUNK_LIMIT", 4 * PAGE)
    fake = FakeCuda()
    fake.fail[1] = 2                              # the second chunk: out of memory (a memlock limit)
    p = pinning.Pinning(lambda: fake)
    with pytest.warns(RuntimeWarning) as w:
        assert not p.register(arena, 1, 2 * PAGE, {CUDA0})
    msg = str(w[0].message)
    assert "cudaErrorMemoryAllocation (2: out of memory)" in msg and "???" not in msg, msg
    assert "stay pageable (slower, still correct)" in msg
    assert fake.pending == 0
    fake.launch()                                 # the next, unrelated kernel launch does not raise
    assert fake.live == {}, "the chunk registered before the failure was not undone"
    with warnings.catch_warnings():
        warnings.simplefilter("error")            # warned once: not retried, not warned again
        assert not p.register(arena, 1, 2 * PAGE, {CUDA0})
    assert len(fake.of("register")) == 2


def test_a_device_without_read_only_registration_is_not_asked(arena):
    fake = FakeCuda(without_read_only={1})
    with pytest.warns(RuntimeWarning, match="cuda:1 cannot register read-only host memory .device attribute 113 is 0"):
        assert not pinning.Pinning(lambda: fake).register(arena, 1, 2 * PAGE, {CUDA0, CUDA1})
    assert fake.of("register") == []


def test_release_syncs_then_unregisters_every_chunk_of_that_mapping_only(arena, monkeypatch):
    monkeypatch.setattr(pinning, "CHUNK_LIMIT", 4 * PAGE)
    other = mmap.mmap(-1, 4 * PAGE, prot=mmap.PROT_READ)
    try:
        fake = FakeCuda()
        p = pinning.Pinning(lambda: fake)
        assert p.register(arena, 1, 2 * PAGE, {CUDA0}) and p.register(other, 2, 2 * PAGE, {CUDA0})
        p.release(arena, lambda: fake.synchronize("all"))
        kinds = [c[0] for c in fake.calls[fake.calls.index(("synchronize", "all", None)):]]
        assert kinds == ["synchronize", "unregister", "unregister", "unregister"]
        assert all(mapped and err == 0 for _, _, _, mapped, err in fake.of("unregister"))
        assert list(fake.live) == [pinning.address_of(other)]
        assert not p.is_registered(arena, 1) and p.is_registered(other, 2)
    finally:
        other.close()


def test_per_device_sync_covers_every_device_with_work():
    from k3client.hf.gpu import GpuSide

    class NoClient:
        before_unmap: list = []

    fake = FakeCuda()
    g = GpuSide(NoClient(), api_factory=lambda: fake)
    g.devices |= {CUDA0, CUDA1}
    g.mark(CUDA1)
    g.mark(CUDA0)
    g.sync()
    assert [c[1] for c in fake.of("synchronize")] == ["cuda:0", "cuda:1"]
    g.sync()                                     # nothing queued since: no sync
    assert len(fake.of("synchronize")) == 2
    g.sync_all()                                 # before an unmap: every device the model used
    assert len(fake.of("synchronize")) == 4


def test_errors_are_named_in_words():
    assert describe(712, "already mapped") == "cudaErrorHostMemoryAlreadyRegistered (712: already mapped)"
    assert describe(4242) == "cudaError (4242)"
