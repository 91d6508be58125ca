"""``--hugepages``: the arena in hugetlb pages, served by the real ``k3d start``.

The refusal (not enough huge pages) runs everywhere.  The serving test needs
huge pages reserved: as root it reserves a few (``vm.nr_hugepages``) for the
test and gives them back; elsewhere it is skipped with the reason."""

import gc
import mmap
import os
import signal
import socket

import pytest

import k3client
from helpers import k3d, reference, verify
from k3d.memory.arena import hugepages

NR = "/proc/sys/vm/nr_hugepages"


def test_not_enough_huge_pages_is_one_line(checkpoint, tmp_path):
    page, free = hugepages()
    arena = (free + 1) * (page or 2**21)     # one huge page more than the pool has free
    r = k3d("start", "--source", checkpoint, "--hugepages", "--arena", arena,
            "--endpoint", f"ipc://{tmp_path}/k.sock")
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and "huge pages" in r.stderr, r.stderr
    if page:
        assert f"{free} are free" in r.stderr and "vm.nr_hugepages" in r.stderr


def test_hugepages_option_parses():
    from k3d.config import ConfigError, resolve
    assert resolve({"hugepages": True}, {}).hugepages is True
    assert resolve({}, {"K3D_HUGEPAGES": "yes"}).hugepages is True
    assert resolve({}, {}).hugepages is False
    with pytest.raises(ConfigError, match="bad value 'maybe' for hugepages: use true or false"):
        resolve({}, {"K3D_HUGEPAGES": "maybe"})


@pytest.fixture
def reserved_hugepages():
    """Reserve 8 more huge pages for the test (root only); restore the pool afterwards."""
    page, _ = hugepages()
    if not page:
        pytest.skip("this kernel has no huge pages")
    try:
        with open(NR) as f:
            old = int(f.read())
        with open(NR, "w") as f:
            f.write(str(old + 8))
    except OSError as e:
        pytest.skip(f"cannot reserve huge pages here ({NR}: {e.strerror}; needs root)")
    try:
        if hugepages()[1] < 8:
            pytest.skip("the kernel could not find 8 free huge pages (memory too fragmented)")
        yield page
    finally:
        with open(NR, "w") as f:
            f.write(str(old))


def test_serves_from_huge_pages(checkpoint, start_daemon, reserved_hugepages, tmp_path):
    """O_DIRECT reads from a packed file into a hugetlb arena: exact bytes, eviction, read-only."""
    page = reserved_hugepages
    packed = tmp_path / "m.k3pack"
    r = k3d("pack", "--no-progress", checkpoint, packed)
    assert r.returncode == 0, r.stderr
    free_before = hugepages()[1]
    d = start_daemon(packed, "--hugepages", "--slots", 8, "--read-mode", "direct")
    ref = reference(checkpoint)
    with k3client.connect(d.endpoint, name="huge") as c:
        st = c.status()
        assert st["arena"]["page_bytes"] == page and st["arena"]["slots"] == 8
        assert hugepages()[1] == free_before - -(-st["arena"]["bytes"] // page)   # taken from the pool
        keys = [(l, e) for l in range(4) for e in range(16)]
        for l, e in keys[::3]:                           # more experts than slots: eviction too
            c.begin_token()
            ex = c.fetch(l, [e])[0]
            verify(c, [ex], ref)
        assert c.status()["stats"]["evictions"] > 0
        # the kernel still refuses a writable mapping of the hugetlb memfd
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.connect(d.endpoint[len("ipc://"):] + ".arena")
            _, fds, _, _ = socket.recv_fds(s, 4096, 1)
        try:
            with pytest.raises(PermissionError):
                mmap.mmap(fds[0], st["arena"]["bytes"], mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fds[0])
    del ex                                              # the last view: the client's mapping goes
    gc.collect()
    assert d.stop(signal.SIGTERM) == 0
    assert hugepages()[1] == free_before                # every huge page back in the pool
