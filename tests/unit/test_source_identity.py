"""Unit: a source file's identity, and the watch that tells a changed file from an unchanged one.

Real files in tmp_path, changed the ways a user changes them: a write in place of the
same size (only mtime moves), a truncation, a ``mv`` over the path (another inode), a
removal, and a change between the source opening the file and the server starting.
"""

import os

import pytest

from k3d.sources.identity import FileWatch, record


@pytest.fixture
def files(tmp_path):
    paths = [str(tmp_path / f"shard-{i}.bin") for i in range(2)]
    for p in paths:
        with open(p, "wb") as f:
            f.write(b"a" * 8192)
        os.utime(p, ns=(1_000_000_000, 1_000_000_000))      # an mtime well in the past
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    yield paths, fds
    for fd in fds:
        os.close(fd)


def test_unchanged_files_pass_and_keep_passing(files):
    paths, fds = files
    w = FileWatch(paths, fds)
    for _ in range(3):
        assert w.check([0, 1]) is None
    assert w.changed == {}


@pytest.mark.parametrize("how,what", [
    ("write", "mtime"), ("truncate", "size 8192 -> 100 bytes"), ("mv", "replaced: inode"), ("rm", "removed")])
def test_each_change_is_named_once_and_stays(files, how, what, caplog):
    paths, fds = files
    w = FileWatch(paths, fds)
    p = paths[1]
    if how == "write":
        with open(p, "r+b") as f:
            f.write(b"b" * 10)                                 # same size: only mtime tells
    elif how == "truncate":
        os.truncate(p, 100)
    elif how == "mv":
        with open(p + ".new", "wb") as f:
            f.write(b"a" * 8192)                               # same bytes, another file
        os.replace(p + ".new", p)
    else:
        os.unlink(p)
    msg = w.check([0, 1])
    assert msg.startswith(f"source file {p} changed while served (") and what in msg, msg
    assert msg.endswith("restart k3d to serve the new checkpoint") and "\n" not in msg
    assert w.check([0]) is None and w.check([1]) == msg      # the other file still passes
    assert list(w.changed) == [1]
    assert caplog.text.count("changed while served") == 1     # logged once


def test_a_change_between_open_and_watch_is_caught(files):
    paths, fds = files
    opened = record(fds)                                      # as open_source records them
    with open(paths[0], "r+b") as f:
        f.write(b"z")                                         # while the arena is being built
    w = FileWatch(paths, fds, opened)
    assert list(w.changed) == [0]
    assert FileWatch(paths, fds).changed == {}                # recorded now, it would be missed


def test_due_checks_every_file_once_a_second(files):
    paths, fds = files
    w = FileWatch(paths, fds, now=100.0)
    os.truncate(paths[0], 1)
    w.due(100.5)
    assert w.changed == {}                                    # not due yet
    w.due(101.0)
    assert list(w.changed) == [0]


def test_reads_check_descriptors_and_the_path_once_a_second(files):
    """A replaced path leaves the descriptor on the old inode, unchanged: the per-batch check
    (descriptors only) passes it, the once-a-second one names it."""
    paths, fds = files
    w = FileWatch(paths, fds, now=0.0)
    with open(paths[0] + ".new", "wb") as f:
        f.write(b"c" * 8192)
    os.replace(paths[0] + ".new", paths[0])
    assert w.check([0], paths=False) is None
    w.due(1.0)
    assert "replaced: inode" in w.changed[0]
    assert w.check([0], paths=False) == w.changed[0]
