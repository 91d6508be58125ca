"""Packed format: `k3d pack` (real CLI) from safetensors and GGUF, served by the real daemon in both
read modes, checksums verified at read time, interrupted packs and lying headers refused."""

import json
import mmap
import os
import signal
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest

import k3client
import k3d.sources.packed as k3d_packed
from helpers import ROOT, k3d, reference, verify
from k3d.config import DEFAULT_PATTERN, ConfigError, resolve
from k3d.demo.synthetic import write_synthetic_gguf
from k3d.reads.plan import split_extents
from k3d.sources import SourceError, open_source
from k3d.sources.checksum import CrcPipeline, crc32, crc32_combine, crc32_of_parts
from k3d.sources.packed import MAGIC, ChecksumError, PackedSource, read_header
from k3d.sources.packwrite import write_pack


@pytest.fixture(scope="module")
def packed(checkpoint, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("pack") / "model.k3pack")
    r = k3d("pack", checkpoint, out)
    assert r.returncode == 0, r.stderr
    assert "100.0% 64/64 experts" in r.stderr and f"into {out}" in r.stderr
    assert not os.path.exists(out + ".partial")
    return out


def test_file_layout(packed, checkpoint):
    h, size = read_header(packed)
    assert open(packed, "rb").read(8) == MAGIC
    assert h["format"] == "k3d-pack" and h["version"] == 1 and h["tensor_format"] == "ocp:MXFP4"
    assert h["stride"] % 4096 == 0 and h["data_offset"] % 4096 == 0
    assert h["keys"] == [[l, e] for l in range(4) for e in range(16)]
    assert size == h["data_offset"] + 64 * h["stride"]
    ref = reference(checkpoint)
    with open(packed, "rb") as f:
        for i, (l, e) in enumerate(h["keys"]):
            f.seek(h["data_offset"] + i * h["stride"])
            blob = f.read(h["stride"])
            assert f"{zlib.crc32(blob):08x}" == h["checksums"][i]
            for name, _dtype, _shape, off, nb in h["layout"]:
                assert blob[off:off + nb] == ref.expert(l, e, name).tobytes()


@pytest.mark.parametrize("mode", ["buffered", "direct"])
def test_daemon_serves_packed(packed, checkpoint, start_daemon, mode):
    d = start_daemon(packed, "--read-mode", mode, "--arena", "4MiB", "--readers", "3")
    ref = reference(checkpoint)
    with k3client.connect(d.endpoint, name=f"packed-{mode}") as c:
        assert c.model["kind"] == "packed" and c.model["read_mode"] == mode
        assert c.model["packed_from"] == "safetensors" and c.model["tensor_format"] == "ocp:MXFP4"
        # one key per fetch splits the read over all readers; many keys read one each
        for layer in range(4):
            c.begin_token()
            verify(c, c.fetch(layer, [layer * 3 % 16]) + c.fetch(layer, [1, 9, 15, 4]), ref)
        st = c.status()
        assert st["stats"]["errors"] == 0
    assert d.stop() == 0


def test_pack_gguf_keeps_tensor_format(tmp_path, start_daemon):
    g = write_synthetic_gguf(str(tmp_path / "m.gguf"), layers=2, experts=4, types=("MXFP4", "Q8_0", "F16"))
    out = str(tmp_path / "m.k3pack")
    r = k3d("pack", g, out, "--no-progress")
    assert r.returncode == 0, r.stderr
    gsrc, psrc = open_source(g, ""), open_source(out, "", "direct")
    try:
        assert psrc.tensor_format == gsrc.tensor_format and psrc.tensor_types == gsrc.tensor_types
        assert psrc.layout == gsrc.layout and sorted(psrc.keys) == sorted(gsrc.keys)
    finally:
        gsrc.close()
        psrc.close()
    d = start_daemon(out, "--read-mode", "direct", "--arena", "4MiB")
    gsrc = open_source(g, "")
    try:
        with k3client.connect(d.endpoint) as c:
            assert c.model["tensor_types"]["ffn_gate_exps.weight"] == "ggml:MXFP4"
            slot = bytearray(gsrc.expert_bytes)
            for ex in c.fetch(1, [3, 0]):
                gsrc.read(gsrc.keys[(1, ex.expert)], memoryview(slot))
                assert bytes(ex.memory()) == bytes(slot)
    finally:
        gsrc.close()
    assert d.stop() == 0


def _corrupt(path, index, at=5000):
    h, _ = read_header(path)
    pos = h["data_offset"] + index * h["stride"] + at
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.mark.parametrize("chunk", [k3d_packed.CHUNK, 3 * 4096])
def test_checksum_mismatch_fails_read_in_parts(packed, tmp_path, monkeypatch, chunk):
    """Parts (split over readers) and pieces (read and checksummed a chunk at a time): a flipped
    byte anywhere fails the expert, a good expert passes with the file's exact bytes."""
    monkeypatch.setattr(k3d_packed, "CHUNK", chunk)
    bad = tmp_path / "bad.k3pack"
    bad.write_bytes(open(packed, "rb").read())
    _corrupt(str(bad), 1 * 16 + 3, at=100_000)
    h, _ = read_header(packed)
    with open(packed, "rb") as f:
        f.seek(h["data_offset"] + (1 * 16 + 4) * h["stride"])
        good = f.read(h["stride"])
    for mode in ("buffered", "direct"):
        src = PackedSource(str(bad), mode)
        buf = mmap.mmap(-1, src.stride)
        slot = memoryview(buf)
        try:
            for parts in (1, 2, 3, 5):
                groups = split_extents(src.keys[(1, 3)], parts)
                assert len(groups) == parts
                with pytest.raises(ChecksumError, match=r"expert \(layer 1, expert 3\)"):
                    for g in reversed(groups):     # completion order does not matter
                        src.read(g, slot)
                slot[:] = bytes(len(slot))
                for g in split_extents(src.keys[(1, 4)], parts):
                    src.read(g, slot)              # a good expert, in parts, passes
                assert slot.tobytes() == good
            # a failed load's leftover parts are not mixed into the next load of the expert
            groups = split_extents(src.keys[(1, 4)], 3)
            src.read(groups[0], slot)
            fresh = memoryview(buf)
            for g in groups:
                src.read(g, fresh)
            fresh.release()
        finally:
            slot.release()
            src.close()
            buf.close()


def test_daemon_never_serves_corrupt_expert(packed, tmp_path, start_daemon):
    bad = tmp_path / "bad.k3pack"
    bad.write_bytes(open(packed, "rb").read())
    _corrupt(str(bad), 2 * 16 + 7)
    d = start_daemon(str(bad), "--read-mode", "direct", "--arena", "4MiB")
    with k3client.connect(d.endpoint) as c:
        for _ in range(2):
            with pytest.raises(k3client.errors.ReadFailed, match=r"checksum mismatch in expert \(layer 2, expert 7\)"):
                c.fetch(2, [7])
        assert len(c.fetch(2, [6, 8])) == 2
        assert c.status()["stats"]["errors"] >= 2
    assert d.stop() == 0


def test_crc32_combine():
    rng = np.random.default_rng(0)
    for n1, n2 in [(1, 1), (4096, 12288), (100_003, 7), (0, 5)]:
        a, b = rng.bytes(n1), rng.bytes(n2)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), n2) == zlib.crc32(a + b)


def test_checksum_is_zlib_ng_and_equals_zlib():
    """The daemon's crc32 is zlib-ng's (the fast one is installed, not silently the fallback)
    and is zlib's function: whole, incremental and on a memoryview of shared memory."""
    assert crc32.__module__.startswith("zlib_ng")
    rng = np.random.default_rng(1)
    data = rng.bytes(3 * (1 << 20) + 123)
    assert crc32(data) == zlib.crc32(data)
    assert crc32(data[777:], crc32(data[:777])) == zlib.crc32(data)
    with mmap.mmap(-1, len(data)) as m:
        m[:] = data
        with memoryview(m) as mv:
            assert crc32(mv[4096:]) == zlib.crc32(data[4096:])


def test_crc_pipeline_runs_and_errors():
    """The companion folds pieces in order; finish() ends a run and starts the next from 0;
    a piece it cannot checksum fails that run at finish(), and the next run is clean."""
    rng = np.random.default_rng(2)
    data = rng.bytes(5 * 65536 + 11)
    p = CrcPipeline()
    try:
        assert p.finish() == 0
        for _ in range(2):
            for pos in range(0, len(data), 65536):
                p.feed(memoryview(data)[pos:pos + 65536])
            assert p.finish() == zlib.crc32(data)
        p.feed(data[:10])
        p.feed(12345)                      # not a buffer
        p.feed(data[10:])
        with pytest.raises(TypeError):
            p.finish()
        p.feed(data)
        assert p.finish() == zlib.crc32(data)
    finally:
        p.close()
    assert not p._thread.is_alive()


def test_crc_pipeline_interrupted_and_closed():
    """A finish() cut short by a signal's exception does not hand its crc to the next run;
    close() wakes a waiting finish() and makes later calls fail instead of hanging."""
    import signal
    import threading
    import time
    big = np.random.default_rng(4).bytes(256 << 20)      # ~10-20 ms of crc32
    small = b"after the interruption"

    class Interrupted(Exception):
        pass

    def interrupt(*_):
        raise Interrupted

    p = CrcPipeline()
    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        for _ in range(20):                               # until a finish() is really cut short
            p.feed(big)
            signal.setitimer(signal.ITIMER_REAL, 0.001)
            try:
                p.finish()
            except Interrupted:
                break
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        else:
            pytest.skip("the timer never fired during a finish()")
        p.feed(small)
        assert p.finish() == zlib.crc32(small)
    finally:
        signal.signal(signal.SIGALRM, old)
    # close() racing a run: finish() returns that run's crc or says closed, never hangs
    outcome = []

    def run():
        p.feed(big)
        p.feed(big)
        try:
            outcome.append(p.finish())
        except RuntimeError as e:
            outcome.append(str(e))
    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.002)                # close at some point of the run: the race itself is the test
    p.close()
    t.join(10)
    assert not t.is_alive(), "finish() hung after close()"
    assert outcome in ([zlib.crc32(big + big)], ["crc pipeline is closed"], ["crc pipeline closed during a run"])
    with pytest.raises(RuntimeError, match="closed"):
        p.feed(small)
    with pytest.raises(RuntimeError, match="closed"):
        p.finish()


def test_failed_read_leaves_no_piece_behind(packed, tmp_path, monkeypatch):
    """A read that fails part-way (the file cut short under a running daemon) fails its expert;
    the reader's checksum companion starts the next expert afresh, so it reads and verifies
    exactly, and close() ends every companion."""
    monkeypatch.setattr(k3d_packed, "CHUNK", 3 * 4096)
    cut = tmp_path / "cut.k3pack"
    cut.write_bytes(open(packed, "rb").read())
    h, _ = read_header(str(cut))
    last = h["data_offset"] + (len(h["keys"]) - 1) * h["stride"]
    with open(packed, "rb") as f:
        f.seek(h["data_offset"])
        first = f.read(h["stride"])
    for mode in ("buffered", "direct"):
        src = PackedSource(str(cut), mode)
        os.truncate(cut, last + h["stride"] // 2)
        buf = mmap.mmap(-1, src.stride)
        slot = memoryview(buf)
        try:
            with pytest.raises(OSError, match="unexpected end of file"):
                src.read(src.keys[tuple(h["keys"][-1])], slot)
            src.read(src.keys[tuple(h["keys"][0])], slot)
            assert slot.tobytes() == first
            companions = list(src._pipelines)
            assert len(companions) == 1
        finally:
            slot.release()
            src.close()
            buf.close()
        assert not any(c._thread.is_alive() for c in companions)
        with pytest.raises(SourceError, match="read after close"):
            src.read(src.keys[tuple(h["keys"][0])], memoryview(bytearray(src.stride)))
        cut.write_bytes(open(packed, "rb").read())


def _killed_pack(checkpoint, out, tmpfile: bool, at: str):
    """Run write_pack in a subprocess that SIGKILLs itself ``at`` "data" (the 5th expert
    read), "publish" (data and header written and fsynced, not yet named OUT) or
    "rename" (the finished file linked beside an existing OUT, not yet renamed over it)."""
    code = textwrap.dedent(f"""
        import errno, os, signal
        import k3d.sources.packwrite as packed
        from k3d.sources import open_source
        if not {tmpfile!r}:             # a file system without O_TMPFILE, as the kernel says it
            real_open = os.open
            def no_tmpfile(path, flags, *a, **k):
                if flags & os.O_TMPFILE == os.O_TMPFILE:
                    raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
                return real_open(path, flags, *a, **k)
            os.open = no_tmpfile
        src = open_source({checkpoint!r}, {DEFAULT_PATTERN!r})
        real, n = src.read, [0]
        def read(ext, slot):
            n[0] += 1
            if {at!r} == "data" and n[0] == 5:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(ext, slot)
        src.read = read
        def die(*a, **k):
            os.kill(os.getpid(), signal.SIGKILL)
        if {at!r} == "publish":
            packed._publish = die
        if {at!r} == "rename":
            os.rename = die
        packed.write_pack(src, {out!r}, progress=False)
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60)
    assert r.returncode == -signal.SIGKILL


def _refused(path, tmp_path, why):
    r = k3d("start", "--source", path, "--endpoint", f"ipc://{tmp_path}/k.sock")
    assert r.returncode == 1 and why in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("at", ["data", "publish"])
def test_interrupted_pack_leaves_nothing(checkpoint, tmp_path, at):
    """O_TMPFILE: the pack has no name until it is complete, so a killed one leaves no file."""
    out = str(tmp_path / "cut.k3pack")
    _killed_pack(checkpoint, out, tmpfile=True, at=at)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("at", ["data", "publish"])
def test_interrupted_named_pack_is_refused(checkpoint, tmp_path, at):
    """Without O_TMPFILE the pack is OUT.partial: refused by name, and, renamed, refused
    for its empty header unless the pack got as far as a complete one."""
    out = str(tmp_path / "cut.k3pack")
    _killed_pack(checkpoint, out, tmpfile=False, at=at)
    assert sorted(os.listdir(tmp_path)) == ["cut.k3pack.partial"]
    _refused(out + ".partial", tmp_path, "unfinished `k3d pack` output")
    os.rename(out + ".partial", out)
    if at == "data":
        _refused(out, tmp_path, "interrupted `k3d pack`")
    else:   # data fsynced before the header: a complete header means a complete file
        assert read_header(out)[0]["keys"]


def test_pack_killed_while_replacing_keeps_the_old_file(checkpoint, packed, tmp_path):
    out = str(tmp_path / "model.k3pack")
    with open(packed, "rb") as f, open(out, "wb") as g:
        g.write(f.read())
    before = open(out, "rb").read()
    _killed_pack(checkpoint, out, tmpfile=True, at="rename")
    assert open(out, "rb").read() == before             # OUT: the old pack, whole
    _refused(out + ".partial", tmp_path, "unfinished `k3d pack` output")


def test_exception_mid_pack_leaves_nothing(checkpoint, tmp_path):
    src = open_source(checkpoint, DEFAULT_PATTERN)
    real, n = src.read, [0]

    def read(ext, slot):
        n[0] += 1
        if n[0] == 7:
            raise OSError("disk went away")
        return real(ext, slot)
    src.read = read
    out = str(tmp_path / "x.k3pack")
    with pytest.raises(OSError, match="disk went away"):
        write_pack(src, out, progress=False)
    src.close()
    assert os.listdir(tmp_path) == []


def _rewrite_header(path, edit):
    with open(path, "rb") as f:
        f.seek(8)
        n = int.from_bytes(f.read(8), "little")
        h = json.loads(f.read(n))
    edit(h)
    raw = json.dumps(h).encode()
    assert 16 + len(raw) <= h["data_offset"]
    with open(path, "r+b") as f:
        f.write(MAGIC + len(raw).to_bytes(8, "little") + raw)


@pytest.mark.parametrize("edit,message", [
    (lambda h: h.update(stride=h["stride"] + 4096), r"stride \d+ is not the span"),
    (lambda h: h.update(span=h["span"] - 1), r"span \d+ is not the layout"),
    (lambda h: h["layout"][1].__setitem__(3, h["layout"][1][3] + 64), "layout offsets are not the slot layout"),
    (lambda h: h["layout"][0].__setitem__(4, 7), r"spans 7 bytes but U8"),
    (lambda h: h["checksums"].pop(), "63 checksums for 64 experts"),
    (lambda h: h["keys"].reverse(), r"keys are not unique and in \(layer, expert\) order"),
    (lambda h: h.update(version=3), "packed format version 3 is not supported"),
    (lambda h: h.update(version=2), "layouts is not"),
    (lambda h: h.update(version=2, layouts=[[[0, 1, 2], h["layout"], {}]]), "layouts do not give layer 3"),
    (lambda h: h.update(version=2, layouts=[[sorted({k[0] for k in h["keys"]}), [["w", "U8", [h["span"] + 1], 0,
                                                                                  h["span"] + 1]], {}]]),
     r"layer 0's layout spans \d+ bytes, more than the \d+-byte slot"),
    (lambda h: h.update(data_offset=h["data_offset"] + 100), "data offset"),
    (lambda h: h.pop("keys"), "header lacks or mangles a field"),
    # the right values with the wrong JSON types: numbers that are not integers become
    # slice bounds and offsets, and a daemon must not start "ready" and then fail every read
    (lambda h: h.update(stride=float(h["stride"])), "span, stride and data_offset must be integers"),
    (lambda h: h.update(span=True), "span, stride and data_offset must be integers"),
    (lambda h: h.update(keys=[], checksums=[]), "keys must be a non-empty list"),
    (lambda h: h["keys"][0].__setitem__(1, 0.0), "keys must be a non-empty list"),
    (lambda h: h.update(source="a string"), "source 'a string' is not an object of strings"),
    (lambda h: h.update(source={"kind": 3}), "is not an object of strings"),
    (lambda h: h.update(tensor_types=["MXFP4"]), "tensor_types .* is not an object of strings"),
    (lambda h: h["layout"][0].__setitem__(2, [-d for d in h["layout"][0][2]]), r"layout entry .*dims >= 0"),
    (lambda h: h["layout"][0].__setitem__(0, 5), "layout entry .* is not"),
    (lambda h: h["layout"][0].__setitem__(1, ["U8"]), "layout entry .* is not"),
])
def test_lying_header(packed, tmp_path, edit, message):
    p = tmp_path / "lie.k3pack"
    p.write_bytes(open(packed, "rb").read())
    _rewrite_header(str(p), edit)
    with pytest.raises(SourceError, match=message):
        open_source(str(p), "")


def test_truncated_and_garbage(packed, tmp_path):
    raw = open(packed, "rb").read()
    p = tmp_path / "t.k3pack"
    p.write_bytes(raw[:-4096])
    with pytest.raises(SourceError, match=r"truncated: \d+ bytes, the header describes \d+ \(64 experts"):
        open_source(str(p), "")
    p.write_bytes(raw[:100])
    with pytest.raises(SourceError, match="header length .* runs past the end"):
        open_source(str(p), "")
    p.write_bytes(b"not a pack file at all")
    with pytest.raises(SourceError, match="bad magic"):
        open_source(str(p), "")


def test_unreadable_pack_is_one_line(tmp_path):
    (tmp_path / "d.k3pack").mkdir()
    with pytest.raises(SourceError, match=r"d.k3pack: cannot read \(Is a directory\)"):
        open_source(str(tmp_path / "d.k3pack"), "")


def test_read_mode_option(checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="--read-mode: bad value 'fast' for read_mode: use buffered or direct"):
        resolve({"read_mode": "fast"}, {})
    assert resolve({}, {"K3D_READ_MODE": "direct"}).read_mode == "direct"
    r = k3d("start", "--source", checkpoint, "--read-mode", "direct", "--endpoint", f"ipc://{tmp_path}/k.sock")
    assert r.returncode == 1 and "--read-mode direct needs a packed file" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_pack_refuses_to_overwrite(packed, checkpoint):
    r = k3d("pack", checkpoint, packed)
    assert r.returncode == 1 and "exists; pass --force" in r.stderr
    r = k3d("pack", packed, packed + "2")
    assert r.returncode == 1 and "already a packed file" in r.stderr


def _resident_fraction(path, start, end) -> float:
    """Fraction of the file's pages in [start, end) that are in the page cache (mincore)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value)
        pages = (size + 4095) // 4096
        vec = ctypes.create_string_buffer(pages)
        assert libc.mincore(addr, size, vec) == 0, ctypes.get_errno()
        libc.munmap(addr, size)
    finally:
        os.close(fd)
    resident = [b & 1 for b in vec.raw[start // 4096:end // 4096]]
    return sum(resident) / max(1, len(resident))


def _drop(path):
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


@pytest.mark.parametrize("mode", ["direct", "buffered"])
def test_reads_leave_page_cache_clean(packed, tmp_path, start_daemon, mode):
    p = str(tmp_path / "pc.k3pack")
    with open(packed, "rb") as f, open(p, "wb") as g:
        g.write(f.read())
    h, size = read_header(p)
    _drop(p)
    if _resident_fraction(p, h["data_offset"], size) > 0.05:
        pytest.skip("this file system does not drop clean pages on POSIX_FADV_DONTNEED")
    d = start_daemon(p, "--read-mode", mode, "--arena", "16MiB")
    with k3client.connect(d.endpoint) as c:
        for layer in range(4):
            c.begin_token()
            c.fetch(layer, list(range(16)))
        assert c.status()["stats"]["misses"] == 64
    assert _resident_fraction(p, h["data_offset"], size) < 0.05
    with open(p, "rb") as f:          # control: a plain buffered read does fill the cache
        f.read()
    assert _resident_fraction(p, h["data_offset"], size) > 0.9
    assert d.stop() == 0


@pytest.mark.parametrize("shift", [0, 512, 4096 + 100])
def test_direct_read_paths(packed, monkeypatch, shift):
    """Through PackedSource.read in direct mode, several pieces per expert: an aligned slot
    takes the plain O_DIRECT path, a slot shifted off page alignment the careful one; both
    fill the slot with the file's exact bytes and pass the checksum."""
    monkeypatch.setattr(k3d_packed, "CHUNK", 3 * 4096)
    src = PackedSource(packed, "direct")
    careful = []
    real = src._read_direct
    monkeypatch.setattr(src, "_read_direct", lambda off, dest: (careful.append(off), real(off, dest)))
    h, _ = read_header(packed)
    i = 5
    with open(packed, "rb") as f:
        f.seek(h["data_offset"] + i * h["stride"])
        want = f.read(h["stride"])
    buf = mmap.mmap(-1, h["stride"] + 2 * 4096)
    slot = memoryview(buf)[shift:shift + h["stride"]]
    try:
        for parts in (1, 3):
            careful.clear()
            slot[:] = bytes(len(slot))
            for g in split_extents(src.keys[tuple(h["keys"][i])], parts):
                src.read(g, slot)
            assert slot.tobytes() == want
            assert bool(careful) == (shift % 4096 != 0), careful[:3]
    finally:
        slot.release()
        src.close()
        buf.close()


def test_direct_handles_unaligned_pieces(packed):
    """O_DIRECT for the aligned middle; unaligned heads, tails and buffers go through the page cache."""
    src = PackedSource(packed, "direct")
    buf = mmap.mmap(-1, 3 * 4096 * 64)
    try:
        with open(packed, "rb") as f:
            for off, length, addr in [(4096, 4096 * 40, 0), (4096 + 100, 4096 * 40, 100),
                                      (4096 + 100, 4096 * 40 - 300, 100), (8192, 4096 * 40 + 17, 0),
                                      (8192, 4096 * 3, 64), (4096 + 5, 10, 5)]:
                f.seek(off)
                want = f.read(length)
                view = memoryview(buf)[addr:addr + length]
                src._read_direct(off, view)
                assert bytes(view) == want, (off, length, addr)
                view.release()
    finally:
        src.close()
        buf.close()


def test_crc32_of_parts_joins_in_offset_order():
    data = os.urandom(10000)
    cuts = [(0, 3000), (3000, 1), (3001, 6999)]
    parts = [(o, n, zlib.crc32(data[o:o + n])) for o, n in cuts]
    assert crc32_of_parts(reversed(parts)) == zlib.crc32(data)
    assert crc32_of_parts([]) == 0
