"""``k3client.trust`` on real memfds and directories: which seals pass, which uids are trusted."""

import fcntl
import os
import pwd

import pytest

from k3client.errors import Untrusted
from k3client.trust import F_SEAL_FUTURE_WRITE, Trust

SIZE = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


def memfd(seals: int) -> int:
    fd = os.memfd_create("t", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    os.ftruncate(fd, 4096)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


@pytest.mark.parametrize("seals, missing", [
    (SIZE | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL, None),        # the daemon's
    (SIZE | fcntl.F_SEAL_WRITE, None),                             # no writable mapping at all: fine too
    (0, "write, shrink, grow seals"),
    (F_SEAL_FUTURE_WRITE, "shrink, grow seals"),
    (SIZE, "write seal"),
    (fcntl.F_SEAL_SHRINK | F_SEAL_FUTURE_WRITE, "grow seal"),
])
def test_seals(seals, missing):
    fd = memfd(seals)
    try:
        if missing is None:
            Trust.sealed(fd, "the arena")
        else:
            with pytest.raises(Untrusted, match=f"the arena lacks the {missing} "):
                Trust.sealed(fd, "the arena")
    finally:
        os.close(fd)


def test_a_file_is_not_a_sealed_memfd(tmp_path):
    p = tmp_path / "arena"
    p.write_bytes(b"\0" * 4096)
    fd = os.open(p, os.O_RDONLY)
    try:
        with pytest.raises(Untrusted, match="the arena is not a sealed memfd"):
            Trust.sealed(fd, "the arena")
    finally:
        os.close(fd)


def test_trusted_uids():
    me = os.geteuid()
    t = Trust()
    assert t.trusted(me) and t.trusted(0)
    nobody = pwd.getpwnam("nobody")
    assert not t.trusted(nobody.pw_uid, nobody.pw_gid)
    g = Trust(str(nobody.pw_gid))                   # nobody's primary group, by gid
    assert g.trusted(nobody.pw_uid) and g.trusted(54321, nobody.pw_gid) and not g.trusted(54321, 54321)
    bare = Trust(987654)                            # a gid without a group entry: peers' gids only
    assert bare.trusted(54321, 987654) and not bare.trusted(54321) and "group 987654" in bare.who()
    with pytest.raises(Untrusted, match="'no-such-group-k3d'.*is no group of this machine"):
        Trust("no-such-group-k3d")


def test_socket_directory_rules(tmp_path):
    d = tmp_path / "run"
    d.mkdir(mode=0o750)
    os.chmod(tmp_path, 0o755)
    Trust().socket_dir(str(d / "k.sock"))
    os.chmod(d, 0o770)
    with pytest.raises(Untrusted, match="writable by group"):
        Trust().socket_dir(str(d / "k.sock"))
    Trust(str(os.stat(d).st_gid)).socket_dir(str(d / "k.sock"))
    link = tmp_path / "link"
    link.symlink_to(d)
    os.chmod(d, 0o750)
    Trust().socket_dir(str(link / "k.sock"))        # a symlink of a trusted owner to a good directory
    os.chmod(d, 0o777)
    with pytest.raises(Untrusted, match="writable by every user"):
        Trust().socket_dir(str(link / "k.sock"))    # the directory it leads to is what counts
