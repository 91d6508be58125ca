"""Offline restart: a remote source with a disk tier starts from its kept headers while the origin
is down, serves what the disk holds, and fetches the rest once the origin answers again.

The origin is the project's fault server (``tests/faulty_http.py``), stopped and started again on
the same port; every expert served is compared with ``safetensors.safe_open``.
"""

from __future__ import annotations

import os

import pytest
from test_http_faults import Reference

from faulty_http import FaultyServer
from k3d.config import DEFAULT_PATTERN
from k3d.demo.synthetic import write_checkpoint
from k3d.reads.plan import split_extents
from k3d.sources import SourceError
from k3d.sources.remote.http import HttpSource
from k3d.sources.remote.kept import kept_path


@pytest.fixture
def root(tmp_path):
    write_checkpoint(str(tmp_path / "origin" / "ck"), layers=2, experts=4, shards=2, seed=41)
    return tmp_path / "origin"


def open_src(url, cache):
    return HttpSource(url, DEFAULT_PATTERN, disk_cache=str(cache), disk_cache_size=1 << 30, timeout=1, retries=2)


def read_expert(src, key):
    slot = memoryview(bytearray(src.expert_bytes))
    for g in split_extents(src.keys[key], 1):
        src.read(g, slot)
    return bytes(slot)


def gets(srv):
    return [r for r in srv.requests if r[0] == "GET"]


def test_origin_down_at_start_then_back(root, tmp_path):
    ref = Reference(root / "ck")
    cache = tmp_path / "cache"
    srv = FaultyServer(str(root)).start()
    port, url = srv.server_address[1], srv.url + "ck/"
    src = open_src(url, cache)
    keys = sorted(src.keys)
    on_disk, rest = keys[:5], keys[5:]
    for key in on_disk:
        ref.check(src, key, read_expert(src, key))
    src.flush()
    src.close()
    assert os.path.exists(kept_path(str(cache), url))
    srv.stop()                                      # the origin goes down

    src = open_src(url, cache)                      # starts from the kept headers
    t = src.tier_stats()
    assert t["origin"]["up"] is False and "failed after" in t["origin"]["error"]
    assert sorted(src.keys) == keys
    for key in on_disk:                             # served from disk, every byte right
        ref.check(src, key, read_expert(src, key))
    with pytest.raises(SourceError, match="failed after 1 attempts"):   # one attempt while down
        read_expert(src, rest[0])

    srv = FaultyServer(str(root), port=port).start()   # the origin comes back
    try:
        for key in rest:
            ref.check(src, key, read_expert(src, key))
        for key in on_disk:
            ref.check(src, key, read_expert(src, key))
        src.flush()
        t = src.tier_stats()
        assert t["origin"]["up"] is True
        # nothing served twice: the origin sent only what the disk lacked, once each
        assert t["origin"]["fetches"] == len(rest) and len(gets(srv)) == len(rest)
        assert t["disk"]["hits"] == 2 * len(on_disk)
    finally:
        src.close()
        srv.stop()


def test_origin_back_with_a_changed_file_serves_no_byte_of_it(root, tmp_path):
    ref = Reference(root / "ck")
    cache = tmp_path / "cache"
    srv = FaultyServer(str(root)).start()
    port, url = srv.server_address[1], srv.url + "ck/"
    src = open_src(url, cache)
    keys = sorted(src.keys)
    ref.check(src, keys[0], read_expert(src, keys[0]))
    src.flush()
    shard = src.files[src.keys[keys[-1]][0].file].rsplit("/", 1)[1]
    src.close()
    srv.stop()
    src = open_src(url, cache)
    srv = FaultyServer(str(root), port=port)
    srv.set_etag(f"ck/{shard}", '"re-uploaded"')     # the file changed while the daemon was offline
    srv.start()
    try:
        with pytest.raises(SourceError, match="412|changed"):
            read_expert(src, keys[-1])
        ref.check(src, keys[0], read_expert(src, keys[0]))   # what the disk holds is still served
    finally:
        src.close()
        srv.stop()


def test_origin_down_without_kept_headers_is_one_line(root, tmp_path):
    srv = FaultyServer(str(root)).start()
    url = srv.url + "ck/"
    srv.stop()
    with pytest.raises(SourceError) as e:
        open_src(url, tmp_path / "cache")
    msg = str(e.value)
    assert "\n" not in msg and "no headers of" in msg and "start once while the origin answers" in msg


def test_s3_origin_down_at_start_then_back(root, tmp_path, monkeypatch):
    """The same through the S3 transport (path-style requests to the fault server as the store)."""
    pytest.importorskip("boto3", reason="S3 sources need boto3")
    from k3d.sources.remote.s3 import S3Source

    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": "/dev/null",
                 "AWS_SHARED_CREDENTIALS_FILE": "/dev/null"}.items():
        monkeypatch.setenv(k, v)
    ref = Reference(root / "ck")
    os.rename(root / "ck", root / "ck-bucket")
    (root / "bucket").mkdir()
    os.rename(root / "ck-bucket", root / "bucket" / "ck")
    srv = FaultyServer(str(root)).start()
    port = srv.server_address[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", srv.url.rstrip("/"))
    cache = tmp_path / "cache"

    def s3src():
        return S3Source("s3://bucket/ck/", DEFAULT_PATTERN, disk_cache=str(cache), disk_cache_size=1 << 30,
                        retries=1, timeout=1)

    src = s3src()
    keys = sorted(src.keys)
    for key in keys[:3]:
        ref.check(src, key, read_expert(src, key))
    src.flush()
    src.close()
    srv.stop()
    src = s3src()
    try:
        assert src.tier_stats()["origin"]["up"] is False
        for key in keys[:3]:
            ref.check(src, key, read_expert(src, key))
        srv = FaultyServer(str(root), port=port).start()
        for key in keys[3:]:
            ref.check(src, key, read_expert(src, key))
        t = src.tier_stats()
        assert t["origin"]["up"] is True and t["origin"]["fetches"] == len(keys) - 3
    finally:
        src.close()
        srv.stop()
