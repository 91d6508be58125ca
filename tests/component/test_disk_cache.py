"""Disk tier: atomic entries, LRU size bound, restart, ETag invalidation, torn entries never served.

Unit tests drive ``DiskCache`` directly; the rest use ``HttpSource`` over the
fault-injecting server (which counts requests) and compare every expert with
``safetensors.safe_open``.  ``kill -9`` is real: a child process is killed
while it writes an entry.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from faulty_http import FaultyServer
from helpers import ROOT, Reference, poll_for
from k3d.config import DEFAULT_PATTERN
from k3d.demo.synthetic import write_checkpoint
from k3d.reads.plan import split_extents
from k3d.sources import SourceError
from k3d.sources.remote.disk_cache import DATA_OFFSET, DiskCache, DiskCacheError, entry_name, read_entry_header
from k3d.sources.remote.http import HttpSource


def entries(d):
    return sorted(f for f in os.listdir(d) if f.endswith(".k3e"))


CLOCK_REALTIME_COARSE = 5      # <linux/time.h>; the time module does not name it


def next_file_tick(d):
    """Wait until a file written now gets a later mtime than every entry in ``d``: file times
    come from the kernel's coarse clock (one tick is 1-10 ms), and recency across a restart
    is read from them."""
    newest = max(os.stat(os.path.join(d, f)).st_mtime_ns for f in entries(d))
    poll_for(lambda: time.clock_gettime_ns(CLOCK_REALTIME_COARSE) > newest, 2, "the file clock to tick",
             interval=0.001)


def test_insert_lookup_and_atomic_files(tmp_path):
    c = DiskCache(str(tmp_path), 1 << 20)
    img = bytes(range(256)) * 64
    assert c.insert("o", (1, 2), "fp", {"u": {"etag": '"a"'}}, img, 1234)
    e = c.lookup("o", (1, 2), "fp", {"u": {"etag": '"a"'}})
    assert e is not None and e.crc32 == 1234 and e.size == DATA_OFFSET + len(img)
    with open(e.path, "rb") as f:
        assert f.read()[DATA_OFFSET:] == img
    assert read_entry_header(e.path)["key"] == [1, 2]
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp-")]
    # wrong validator (the origin's ETag changed) or fingerprint: a miss, and the entry is gone
    assert c.lookup("o", (1, 2), "fp", {"u": {"etag": '"b"'}}) is None
    assert entries(tmp_path) == [] and c.bytes == 0
    c.close()


def test_lru_bound_and_order_survive_restart(tmp_path):
    img = bytes(8192)
    size = DATA_OFFSET + len(img)
    c = DiskCache(str(tmp_path), 3 * size)
    for i in range(3):
        c.insert("o", (0, i), "fp", {}, img, 0)
        next_file_tick(tmp_path)
    assert c.lookup("o", (0, 0), "fp", {})          # (0, 0) becomes most recent
    c.insert("o", (0, 3), "fp", {}, img, 0)          # evicts (0, 1), the least recent
    assert c.bytes <= 3 * size and len(entries(tmp_path)) == 3
    assert c.lookup("o", (0, 1), "fp", {}) is None and c.evictions == 1
    c.close()
    # restart with a smaller bound: recency comes from mtimes (a hit touches the file)
    c = DiskCache(str(tmp_path), 2 * size)
    assert c.bytes == 2 * size
    assert c.lookup("o", (0, 2), "fp", {}) is None
    assert c.lookup("o", (0, 0), "fp", {}) and c.lookup("o", (0, 3), "fp", {})
    c.close()


def test_one_daemon_per_directory(tmp_path):
    c = DiskCache(str(tmp_path), 1 << 20)
    with pytest.raises(DiskCacheError, match="in use by another k3d"):
        DiskCache(str(tmp_path), 1 << 20)
    c.close()
    DiskCache(str(tmp_path), 1 << 20).close()


def test_malformed_and_tmp_files_are_removed_at_start(tmp_path):
    c = DiskCache(str(tmp_path), 1 << 20)
    c.insert("o", (0, 0), "fp", {}, bytes(4096), 0)
    c.close()
    good = os.path.join(tmp_path, entries(tmp_path)[0])
    with open(os.path.join(tmp_path, "f" * 32 + ".k3e"), "wb") as f:
        f.write(b"K3DCACHE" + bytes(100))                 # torn header
    with open(good, "rb") as f:
        data = f.read()
    with open(os.path.join(tmp_path, "e" * 32 + ".k3e"), "wb") as f:
        f.write(data[:-10])                                # short data
    with open(os.path.join(tmp_path, ".tmp-x-1-0"), "wb") as f:
        f.write(data)
    c = DiskCache(str(tmp_path), 1 << 20)
    assert sorted(os.listdir(tmp_path)) == sorted([".lock", os.path.basename(good)])
    assert len(c._lru) == 1
    c.close()


def test_kill9_while_writing_leaves_nothing_served(tmp_path):
    """A writer killed between write and rename (here: stuck in fsync) leaves only a .tmp- file."""
    d = tmp_path / "dc"
    code = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {ROOT!r})
        from k3d.sources.remote.disk_cache import DiskCache
        c = DiskCache({str(d)!r}, 1 << 30)
        c.insert("o", (0, 0), "fp", {{}}, bytes(1 << 16), 0)
        def stuck(fd):
            print("writing", flush=True)
            time.sleep(60)
        os.fsync = stuck
        c.insert("o", (0, 1), "fp", {{}}, b"x" * (8 << 20), 0)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "writing"
    p.send_signal(signal.SIGKILL)
    p.wait(10)
    names = os.listdir(d)
    assert any(n.startswith(".tmp-") for n in names) and len([n for n in names if n.endswith(".k3e")]) == 1
    c = DiskCache(str(d), 1 << 30)
    assert c.lookup("o", (0, 1), "fp", {}) is None and c.lookup("o", (0, 0), "fp", {}) is not None
    assert not [n for n in os.listdir(d) if n.startswith(".tmp-")]
    c.close()


# -- through the HTTP source ------------------------------------------------------------------
@pytest.fixture(scope="module")
def origin(tmp_path_factory):
    root = tmp_path_factory.mktemp("origin")
    write_checkpoint(str(root / "ck"), layers=2, experts=4, shards=2, seed=31)
    srv = FaultyServer(str(root)).start()
    yield srv, Reference(root / "ck")
    srv.stop()


def read_expert(src, key, parts=2):
    slot = memoryview(bytearray(src.expert_bytes))
    for g in split_extents(src.keys[key], parts):
        src.read(g, slot)
    return bytes(slot)


def open_src(srv, cache, size=1 << 30):
    src = HttpSource(srv.url + "ck/", DEFAULT_PATTERN, disk_cache=str(cache), disk_cache_size=size,
                     timeout=2, retries=2)
    srv.clear()
    return src


def origin_gets(srv):
    return [r for r in srv.requests if r[0] == "GET" and r[2]]


def test_second_read_and_restart_come_from_disk(origin, tmp_path):
    srv, ref = origin
    src = open_src(srv, tmp_path)
    for key in sorted(src.keys):
        ref.check(src, key, read_expert(src, key))
    src.flush()
    cold = len(origin_gets(srv))
    assert cold == 16                        # two parts per expert, one range request each
    for key in sorted(src.keys):
        ref.check(src, key, read_expert(src, key, parts=3))
    t = src.tier_stats()
    assert t["disk"]["hits"] == 8 and t["origin"]["fetches"] == 8 and t["disk"]["entries"] == 8
    assert len(origin_gets(srv)) == cold     # nothing more from the origin
    src.close()
    src = open_src(srv, tmp_path)             # "restart": a new source over the same directory
    for key in sorted(src.keys):
        ref.check(src, key, read_expert(src, key))
    assert src.tier_stats()["disk"]["hits"] == 8 and origin_gets(srv) == []
    src.close()


def test_corrupt_entry_is_never_served(origin, tmp_path):
    srv, ref = origin
    src = open_src(srv, tmp_path)
    read_expert(src, (1, 1))
    src.flush()
    path = os.path.join(tmp_path, entry_name(src.path, (1, 1)) + ".k3e")
    with open(path, "r+b") as f:
        f.seek(DATA_OFFSET + src.layout[0].offset + 7)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x55]))
    ref.check(src, (1, 1), read_expert(src, (1, 1), parts=4))   # refetched from the origin
    t = src.tier_stats()
    assert t["disk"]["corrupt"] == 1 and t["disk"]["hits"] == 0 and t["origin"]["fetches"] == 2
    src.flush()
    ref.check(src, (1, 1), read_expert(src, (1, 1)))             # rewritten entry is good again
    assert src.tier_stats()["disk"]["hits"] == 1
    src.close()


@pytest.mark.parametrize("damage", ["deleted", "unreadable"])
def test_entry_gone_under_the_daemon_is_read_from_the_origin_and_rewritten(origin, tmp_path, damage):
    """An entry file deleted (or replaced by something that cannot be read) while the index
    still lists it: the expert comes from the origin, counted as such, and is written back."""
    srv, ref = origin
    src = open_src(srv, tmp_path)
    read_expert(src, (0, 2))
    src.flush()
    path = os.path.join(tmp_path, entry_name(src.path, (0, 2)) + ".k3e")
    os.unlink(path)
    if damage == "unreadable":
        os.mkdir(path)                      # open() works, every read fails (EISDIR)
    ref.check(src, (0, 2), read_expert(src, (0, 2), parts=1))
    t = src.tier_stats()
    assert t["disk"]["hits"] == 0 and t["origin"]["fetches"] == 2 and t["disk"]["corrupt"] == 1
    if damage == "unreadable":
        os.rmdir(path)
    src.flush()
    assert os.path.isfile(path)             # written again
    ref.check(src, (0, 2), read_expert(src, (0, 2)))
    assert src.tier_stats()["disk"]["hits"] == 1
    src.close()


def test_changed_origin_etag_invalidates_entries(origin, tmp_path):
    srv, ref = origin
    src = open_src(srv, tmp_path)
    for key in [(0, 0), (1, 0)]:
        read_expert(src, key)
    src.close()
    srv.set_etag("ck/model-00001-of-00002.safetensors", '"v2"')
    try:
        src = open_src(srv, tmp_path)
        ref.check(src, (0, 0), read_expert(src, (0, 0)))          # shard 1 changed: from the origin
        ref.check(src, (1, 0), read_expert(src, (1, 0)))          # shard 2 did not: from disk
        t = src.tier_stats()
        assert t["disk"]["hits"] == 1 and t["origin"]["fetches"] == 1
        src.close()
    finally:
        srv.etags.clear()


def test_size_bound_holds_through_the_source(origin, tmp_path):
    srv, ref = origin
    src = open_src(srv, tmp_path)
    one = DATA_OFFSET + src.expert_bytes
    src.close()
    src = open_src(srv, tmp_path, size=3 * one)
    for key in sorted(src.keys):
        read_expert(src, key)
        src.flush()
    st = src.tier_stats()["disk"]
    assert st["entries"] == 3 and st["bytes"] <= 3 * one and st["evictions"] == 5
    assert sum(os.path.getsize(os.path.join(tmp_path, f)) for f in entries(tmp_path)) <= 3 * one
    src.close()


def test_cache_dir_in_use_is_a_clear_start_error(origin, tmp_path):
    srv, _ = origin
    src = open_src(srv, tmp_path)
    with pytest.raises(SourceError, match="in use by another k3d"):
        open_src(srv, tmp_path)
    src.close()


def test_daemon_kill9_during_write_behind_then_restart(origin, start_daemon, tmp_path):
    """kill -9 right after fetches (entries mid-write): the next daemon serves only whole, correct entries."""
    import k3client
    srv, ref = origin
    cache = tmp_path / "dc"
    args = ("--arena", "4MiB", "--disk-cache", str(cache), "--disk-cache-size", "64MiB")
    d = start_daemon(srv.url + "ck/", *args)
    with k3client.connect(d.endpoint, name="k") as c:
        c.fetch(0, [0, 1, 2, 3])
        d.stop(signal.SIGKILL)
    d = start_daemon(srv.url + "ck/", *args)
    assert not [n for n in os.listdir(cache) if n.startswith(".tmp-")]
    with k3client.connect(d.endpoint, name="k") as c:
        for ex in c.fetch(0, [0, 1, 2, 3]):
            for spec in c.layout:
                want = ref.tensors[DEFAULT_PATTERN.format(layer=ex.layer, expert=ex.expert, name=spec.name)]
                assert ex.array(spec.name).tobytes() == want.tobytes()
        t = c.status()["model"]["tiers"]
    assert t["disk"]["hits"] + t["origin"]["fetches"] == 4 and t["disk"]["corrupt"] == 0
    assert d.stop() == 0


def test_full_write_backlog_skips_instead_of_slowing_fetches(origin, tmp_path, monkeypatch):
    import k3d.sources.remote.tiers as sh
    srv, ref = origin
    monkeypatch.setattr(sh, "WRITE_BACKLOG", 1)
    src = open_src(srv, tmp_path)
    ref.check(src, (0, 2), read_expert(src, (0, 2)))
    src.flush()
    d = src.tier_stats()["disk"]
    assert d["write_skipped"] == 1 and d["entries"] == 0
    src.close()
