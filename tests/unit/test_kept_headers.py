"""Kept headers of a remote source (k3d/sources/remote/kept.py): record, keep, replay."""

import json
import os

import pytest

from k3d.sources.remote.kept import OriginDown, Recorder, Replay, kept_path


def origin():
    files = ["http://o/a.safetensors", "http://o/b.safetensors"]
    blobs = {files[0]: bytes(range(256)) * 4, files[1]: b"xyz" * 100}
    stat = lambda url: (len(blobs[url]), {"etag": f'"{len(blobs[url])}"'})  # noqa: E731
    small = lambda url: b'{"weight_map": {}}' if url.endswith(".json") else None  # noqa: E731
    ranges = lambda fi, start, length: blobs[files[fi]][start:start + length]  # noqa: E731
    return files, stat, small, ranges


def test_recorded_answers_replay_exactly(tmp_path):
    files, stat, small, ranges = origin()
    rec = Recorder("http://o/")

    def st(url):
        rec.keep_stat(url, *stat(url))
        return stat(url)

    def sm(url):
        rec.keep_small(url, small(url))
        return small(url)

    def rg(fi, start, length):
        rec.keep_range(files[fi], start, ranges(fi, start, length))
        return ranges(fi, start, length)
    answers = [st(files[0]), st(files[1]), sm("http://o/model.safetensors.index.json"), sm("http://o/x"),
               rg(0, 0, 100), rg(0, 100, 50), rg(1, 3, 9)]
    path = rec.save(str(tmp_path))
    assert path == kept_path(str(tmp_path), "http://o/") and not os.listdir(os.path.dirname(path))[1:]
    rp = Replay.load(str(tmp_path), "http://o/")
    rr = rp.ranges(files)
    again = [rp.stat(files[0]), rp.stat(files[1]), rp.small("http://o/model.safetensors.index.json"),
             rp.small("http://o/x"), rr(0, 0, 100), rr(0, 100, 50), rr(1, 3, 9)]
    assert [tuple(a) if isinstance(a, list) else a for a in again] == answers
    assert rr(0, 10, 20) == ranges(0, 10, 20)          # inside a kept range


def test_what_was_never_asked_is_origin_down(tmp_path):
    files, stat, small, ranges = origin()
    rec = Recorder("http://o/")
    rec.keep_range(files[0], 0, ranges(0, 0, 10))
    rec.save(str(tmp_path))
    rp = Replay.load(str(tmp_path), "http://o/")
    with pytest.raises(OriginDown, match="not among the headers kept"):
        rp.ranges(files)(0, 5, 10)
    with pytest.raises(OriginDown):
        rp.stat(files[1])


def test_no_or_foreign_or_broken_record_is_none(tmp_path):
    assert Replay.load(str(tmp_path), "http://o/") is None
    Recorder("http://other/").save(str(tmp_path))
    path = kept_path(str(tmp_path), "http://o/")
    os.replace(kept_path(str(tmp_path), "http://other/"), path)     # another URL's record under this name
    assert Replay.load(str(tmp_path), "http://o/") is None
    with open(path, "w") as f:
        f.write("{not json")
    assert Replay.load(str(tmp_path), "http://o/") is None
    with open(path, "w") as f:
        json.dump({"version": 99, "url": "http://o/"}, f)
    assert Replay.load(str(tmp_path), "http://o/") is None
