"""S3 source against a real S3 protocol server on loopback (moto in server mode).

The checkpoint is uploaded with boto3; the source (in this process, and the real
``k3d start``) finds the endpoint and credentials in the standard AWS
environment variables.  Every expert is compared with ``safetensors.safe_open``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

boto3 = pytest.importorskip("boto3", reason="S3 tests need boto3 (pip install 'moto[server]' boto3)")
pytest.importorskip("moto.server", reason="S3 tests need moto's server (pip install 'moto[server]')")

import k3client  # noqa: E402
from helpers import Reference, moto_s3  # noqa: E402
from k3d.config import DEFAULT_PATTERN  # noqa: E402
from k3d.demo.synthetic import write_checkpoint  # noqa: E402
from k3d.reads.plan import split_extents  # noqa: E402
from k3d.sources import SourceError  # noqa: E402
from k3d.sources.remote.s3 import S3Source  # noqa: E402

BUCKET = "k3d-models"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with moto_s3() as env:
        root = tmp_path_factory.mktemp("s3src")
        ck = write_checkpoint(str(root / "ck"), layers=2, experts=4, shards=2, seed=41)
        client = boto3.client("s3")
        client.create_bucket(Bucket=BUCKET)
        for f in os.listdir(ck):
            client.upload_file(os.path.join(ck, f), BUCKET, f"models/ck/{f}")
        yield client, env, Reference(ck), ck

def read_expert(src, key, parts=2):
    slot = memoryview(bytearray(src.expert_bytes))
    for g in split_extents(src.keys[key], parts):
        src.read(g, slot)
    return bytes(slot)


def test_s3_source_reads_every_expert(s3):
    client, env, ref, _ = s3
    src = S3Source(f"s3://{BUCKET}/models/ck/", DEFAULT_PATTERN, conns=2)
    assert src.kind == "s3" and src.format == "safetensors" and len(src.keys) == 8
    assert all(v["etag"].startswith('"') for v in src.validators)
    before = src.tier_stats()["origin"]["requests"]
    for key in sorted(src.keys):
        ref.check(src, key, read_expert(src, key, parts=1))
    t = src.tier_stats()["origin"]
    assert t["requests"] - before == 8 and t["fetches"] == 8 and t["errors"] == 0   # one GET per expert
    src.close()


def test_s3_replaced_object_is_an_error_naming_it(s3, tmp_path):
    client, env, ref, ck = s3
    for f in os.listdir(ck):
        client.upload_file(os.path.join(ck, f), BUCKET, f"models/ck2/{f}")
    src = S3Source(f"s3://{BUCKET}/models/ck2/", DEFAULT_PATTERN)
    ref.check(src, (0, 0), read_expert(src, (0, 0)))
    shard = "model-00001-of-00002.safetensors"
    data = bytearray(open(os.path.join(ck, shard), "rb").read())
    data[-1] ^= 1                                     # a re-upload with different bytes: a new ETag
    client.put_object(Bucket=BUCKET, Key=f"models/ck2/{shard}", Body=bytes(data))
    with pytest.raises(SourceError, match=f"origin changed: s3://{BUCKET}/models/ck2/{shard}.*412"):
        read_expert(src, (0, 1))
    src.close()


def test_s3_missing_prefix_is_clear(s3):
    with pytest.raises(SourceError, match="neither model.safetensors.index.json nor model.safetensors"):
        S3Source(f"s3://{BUCKET}/nothing/", DEFAULT_PATTERN)
    with pytest.raises(SourceError, match="404"):
        S3Source(f"s3://{BUCKET}/models/ck/none.safetensors", DEFAULT_PATTERN)


def test_s3_missing_object_is_one_clause(s3):
    """A 404 on HeadObject reads as one error, not wrapped in a second 'SourceError:' clause."""
    url = f"s3://{BUCKET}/models/ck/none.gguf"
    with pytest.raises(SourceError) as ei:
        S3Source(url, DEFAULT_PATTERN)
    assert str(ei.value) == f"HeadObject {url}: HTTP 404 (not found)"


def test_daemon_from_s3_with_disk_cache(s3, start_daemon, tmp_path):
    client, env, ref, _ = s3
    args = ("--arena", "4MiB", "--disk-cache", str(tmp_path / "dc"), "--disk-cache-size", "64MiB")
    d = start_daemon(f"s3://{BUCKET}/models/ck/", *args, env=dict(os.environ, **env))
    with k3client.connect(d.endpoint, name="s3") as c:
        for ex in c.fetch(1, [0, 1, 2, 3]):
            for spec in c.layout:
                want = ref.expert(ex.layer, ex.expert, spec.name)
                assert np.array_equal(ex.array(spec.name), want)
        t = c.status()["model"]["tiers"]
    assert t["origin"]["fetches"] == 4 and t["origin"]["url"] == f"s3://{BUCKET}/models/ck/"
    assert d.stop() == 0
    d = start_daemon(f"s3://{BUCKET}/models/ck/", *args, env=dict(os.environ, **env))
    with k3client.connect(d.endpoint, name="s3") as c:
        c.fetch(1, [0, 1, 2, 3])
        t = c.status()["model"]["tiers"]
    assert t["disk"]["hits"] == 4 and t["origin"]["fetches"] == 0
    assert d.stop() == 0


# -- the S3 transport against the fault-injecting server (a path-style "bucket" directory) -----
from faulty_http import Fault, FaultyServer  # noqa: E402


@pytest.fixture
def faulty_s3(s3, tmp_path, monkeypatch):
    _, _, ref, ck = s3
    bucket = tmp_path / "fault-bucket" / "ck"
    bucket.mkdir(parents=True)
    for f in os.listdir(ck):
        (bucket / f).write_bytes(open(os.path.join(ck, f), "rb").read())
    srv = FaultyServer(str(tmp_path)).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", srv.url.rstrip("/"))
    src = S3Source("s3://fault-bucket/ck/", DEFAULT_PATTERN, retries=2, timeout=1)
    srv.clear()
    yield srv, src, ref
    src.close()
    srv.stop()


@pytest.mark.parametrize("kind", ["truncate", "reset", "status"])
def test_s3_transient_faults_are_retried(faulty_s3, kind):
    srv, src, ref = faulty_s3
    srv.add(Fault(kind, times=2, status=503))
    ref.check(src, (1, 1), read_expert(src, (1, 1)))
    assert src.tier_stats()["origin"]["retries"] >= 1


@pytest.mark.parametrize("fault,match", [
    (Fault("ignore_range", times=None), "ignored the Range"),
    (Fault("status", times=None, status=500), "after 3 attempts.*500"),
    (Fault("bad_range", times=None), "ContentRange is 'bytes "),
])
def test_s3_bad_answers_are_errors(faulty_s3, fault, match):
    srv, src, ref = faulty_s3
    srv.add(fault)
    with pytest.raises(SourceError, match=match):
        read_expert(src, (0, 2))
    srv.clear()
    ref.check(src, (0, 2), read_expert(src, (0, 2)))


def test_s3_etag_change_mid_run(faulty_s3):
    srv, src, ref = faulty_s3
    srv.set_etag("fault-bucket/ck/model-00002-of-00002.safetensors", '"other"')
    with pytest.raises(SourceError, match="origin changed: s3://fault-bucket/ck/model-00002-of-00002"):
        read_expert(src, (1, 0))
    ref.check(src, (0, 0), read_expert(src, (0, 0)))
