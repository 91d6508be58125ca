"""The arena in transparent huge pages (``k3d/memory/thp.py``), by default, and ``--no-thp``.

Collapsing needs a kernel with MADV_COLLAPSE for shmem (6.1+, ``shmem_enabled``
not ``deny``); elsewhere those tests are skipped with the reason.  Physical
contiguity is checked from /proc/self/pagemap, which shows frame numbers to
root only (skipped otherwise)."""

import mmap
import os
import struct

import numpy as np
import pytest

import k3client
import k3d.memory.thp as thp
from helpers import held_launcher, poll_for, reference, verify
from k3d.commands.ctl import render
from k3d.config import ConfigError, resolve
from k3d.memory.arena import Arena, memfd_bytes
from k3d.memory.thp import collapse, pmd_bytes, region_bytes

PMD = pmd_bytes()


def _can_collapse() -> str:
    """"" where this kernel collapses shmem (tried on one region), else why not."""
    if not region_bytes():
        return "no transparent huge pages for shmem on this kernel"
    fd = os.memfd_create("thp-probe", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, PMD)
        done, why = collapse(fd, PMD)
        return "" if done == PMD else f"this kernel does not collapse shmem here: {why}"
    finally:
        os.close(fd)


CANNOT = _can_collapse()
needs_collapse = pytest.mark.skipif(bool(CANNOT), reason=CANNOT or "-")


def _frames(buf, length):
    """Physical frame of each 4 KiB page of ``buf`` (touched first), or None when hidden (not root)."""
    addr = np.frombuffer(buf, np.uint8).ctypes.data
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(addr // 4096 * 8)
        entries = struct.unpack(f"{length // 4096}Q", f.read(length // 4096 * 8))
    frames = [e & ((1 << 55) - 1) for e in entries]
    if not any(frames):
        return None
    assert all(e >> 63 for e in entries), "a page is not present"
    return frames


def _fs_type(path: str) -> str:
    """The file system type of the mount holding ``path`` (longest mount point prefix)."""
    best, kind = "", ""
    with open("/proc/self/mounts") as f:
        for line in f:
            _, point, fstype = line.split()[:3]
            if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
                best, kind = point, fstype
    return kind


@needs_collapse
def test_collapse_makes_2mib_runs_every_mapping_sees():
    length = 3 * PMD + 8192                  # three whole regions and a tail that stays small pages
    fd = os.memfd_create("thp-test", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, length)
        done, why = collapse(fd, length)
        if done < 3 * PMD:
            pytest.skip(f"the kernel collapsed {done // PMD} of 3 regions: {why}")
        assert done == 3 * PMD and "less than a region" in why
        os.posix_fallocate(fd, 0, length)
        data = np.random.default_rng(3).integers(0, 256, length, dtype=np.uint8)
        with mmap.mmap(fd, length) as a, mmap.mmap(fd, length, prot=mmap.PROT_READ) as b:
            np.frombuffer(a, np.uint8)[:] = data           # written through one mapping ...
            assert np.array_equal(np.frombuffer(b, np.uint8), data)   # ... read through another
            frames = _frames(b, length)
            if frames is None:
                pytest.skip("pagemap hides frame numbers (not root)")
            for r in range(3):                 # each region: 512 physically consecutive frames
                run = frames[r * PMD // 4096:(r + 1) * PMD // 4096]
                assert run == list(range(run[0], run[0] + len(run))), f"region {r} is not contiguous"
                assert run[0] % (PMD // 4096) == 0, f"region {r} is not a huge page"
    finally:
        os.close(fd)


def test_collapse_leaves_what_it_cannot_take(tmp_path):
    """A file that is not shmem (a writable mapping of ext4 here): nothing collapsed, nothing changed."""
    p = tmp_path / "plain"
    data = os.urandom(2 * max(PMD, 4096))
    p.write_bytes(data)
    if _fs_type(str(p)) in ("tmpfs", "shmem"):
        pytest.skip("the test's tmp directory is tmpfs (shmem can be collapsed)")
    fd = os.open(p, os.O_RDWR)
    try:
        assert collapse(fd, len(data))[0] == 0
    finally:
        os.close(fd)
    assert p.read_bytes() == data


def test_thp_option_parses():
    assert resolve({}, {}).thp is True
    assert resolve({"thp": False}, {}).thp is False
    assert resolve({}, {"K3D_THP": "false"}).thp is False
    with pytest.raises(ConfigError, match="bad value 'sometimes' for thp"):
        resolve({}, {"K3D_THP": "sometimes"})


@needs_collapse
def test_daemon_arena_in_transparent_huge_pages(checkpoint, start_daemon):
    d = start_daemon(checkpoint, "--slots", 5)
    with k3client.connect(d.endpoint, name="thp") as c:
        a = c.status()["arena"]
        assert a["bytes"] % PMD, "pick a slot count whose arena is not whole huge pages"
        assert len(c.arena) == -(-a["bytes"] // PMD) * PMD       # the memfd: whole huge pages
        assert a["page_bytes"] == 4096 and a["thp_bytes"] > 0 and a["thp_bytes"] % PMD == 0
        if a["thp_bytes"] < len(c.arena):
            pytest.skip(f"the kernel collapsed {a['thp_bytes'] >> 20} of {len(c.arena) >> 20} MiB (memory fragmented)")
        assert "(100% in transparent huge pages)" in render(c.status())
        ref = reference(checkpoint)
        for l, e in [(0, 1), (1, 2), (3, 15)]:
            ex = c.fetch(l, [e])[0]
            verify(c, [ex], ref)
            del ex
            c.begin_token()
    assert d.stop() == 0
    assert "in transparent huge pages" in d.log()


def test_no_thp_leaves_4k_pages(checkpoint, start_daemon):
    d = start_daemon(checkpoint, "--slots", 5, "--no-thp")
    with k3client.connect(d.endpoint, name="no-thp") as c:
        a = c.status()["arena"]
        assert a["thp_bytes"] == 0 and len(c.arena) == a["bytes"]   # not collapsed, not rounded
        assert "transparent" not in render(c.status())
        assert len(c.fetch(0, [0, 1])) == 2
    assert d.stop() == 0
    assert "transparent huge pages" not in d.log()


def test_arena_without_collapse_is_a_plain_arena(monkeypatch):
    """Where the kernel refuses MADV_COLLAPSE (an advice it does not know: EINVAL, as before
    Linux 6.1) or THP for shmem is denied, the arena is built as ever: nothing collapsed,
    the reason said, every byte written reads back."""
    slot = 3 * 4096 * 100
    monkeypatch.setattr(thp, "MADV_COLLAPSE", 12345)
    a = Arena(3, slot)
    try:
        if region_bytes():
            assert a.thp_bytes == 0 and "cannot collapse" in a.thp_why
        data = np.random.default_rng(5).integers(0, 256, slot, dtype=np.uint8)
        np.frombuffer(a.view(2), np.uint8)[:] = data
        assert np.array_equal(np.frombuffer(a.view(2), np.uint8), data)
    finally:
        a.close()
    monkeypatch.setattr(thp, "shmem_policy", lambda: "deny")
    assert region_bytes() == 0 and memfd_bytes(3 * slot, False, True) == 3 * slot
    a = Arena(3, slot)
    try:
        assert a.thp_bytes == 0 and "deny" in a.thp_why and a.mapped == 3 * slot
    finally:
        a.close()


def test_serves_correct_bytes_while_the_arena_is_still_prepared(checkpoint, start_daemon, tmp_path):
    """Ready comes before the collapse and pre-fault: status says they still run, every slot
    filled meanwhile reads right, and stays right once the preparer has collapsed (copied)
    and pre-faulted the regions under it."""
    gate = tmp_path / "gate"
    # its start collapses nothing (every region is left to the preparer), which holds before
    # its first step until the file ``gate`` exists
    no_front = ("from k3d.memory import thp\n"
                "thp.Collapser.front = lambda self, fd, length, floor=None, progress=None: (0, '')")
    d = start_daemon(checkpoint, "--slots", 64,
                     launcher=held_launcher("k3d.memory.prepare", "Preparer", gate, "preparer", prelude=no_front))
    poll_for(lambda: "gate: preparer holding" in d.log(), 30, d.log)
    ref = reference(checkpoint)
    with k3client.connect(d.endpoint, name="early", hit_path="daemon") as c:
        a = c.status()["arena"]
        assert a["prepare"]["state"] == "running" and a["prepare"]["done"] == 0 and a["thp_bytes"] == 0
        assert "preparing in the background (0 % pre-faulted)" in render(c.status())
        keys = [(l, e) for l in range(4) for e in range(16)]          # every slot of the arena
        for l in range(4):
            got = c.fetch(l, list(range(16)))
            verify(c, got, ref)
            del got
            c.begin_token()
        gate.touch()
        poll_for(lambda: c.status()["arena"]["prepare"]["state"] == "done", 60, lambda: c.status()["arena"])
        a = c.status()["arena"]
        assert a["prepare"]["done"] == a["prepare"]["total"] == len(c.arena)
        for l in range(4):                     # all hits now: the bytes the preparer moved
            got = c.fetch(l, list(range(16)))
            verify(c, got, ref)
            del got
            c.begin_token()
        st = c.status()
        assert st["stats"]["misses"] == len(keys) and st["stats"]["hits"] == len(keys)
        assert "preparing" not in render(st)
    assert d.stop() == 0
    assert "arena: pre-faulted" in d.log()
    if not CANNOT:     # collapsed under the filled slots (a copy), unless memory was short just then
        assert a["thp_bytes"] == a["prepare"]["total"] or "memory fragmented or short" in d.log(), d.log()


def test_arena_closes_while_its_preparer_runs():
    """close() stops the preparer before it unmaps: no fault, no thread left behind."""
    a = Arena(256, 4 << 20, thp=False)      # 1 GiB of 4 KiB pages: 16 pre-fault steps
    a.prepare()
    a.close()
    st = a.prepare_status()
    assert st["state"] in ("stopped", "done") and a.preparer.join(0)      # the thread has ended
    assert st["state"] == "done" or st["done"] < st["total"]
