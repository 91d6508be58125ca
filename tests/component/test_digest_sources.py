"""The daemon's content digest from every kind of source, against the client's from local files.

Real checkpoints (the reference safetensors and gguf writers, ``k3d pack``), real
sources (local, nginx over HTTP, moto's S3 server); the daemon side is
``k3d.sources.digest.for_source``, the client side ``k3client.local_experts.digest``
on the local files the remote ones were uploaded from.
"""

from __future__ import annotations

import os

import pytest

from faulty_http import Nginx, nginx_binary
from helpers import moto_s3
from k3client.digest import BLOCK, BLOCKS, first_difference, sampled_bytes
from k3client.local_experts import digest as local_digest
from k3d.config import DEFAULT_PATTERN
from k3d.demo.synthetic import write_checkpoint, write_synthetic_gguf
from k3d.sources import open_source
from k3d.sources.digest import for_source
from k3d.sources.packwrite import write_pack


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    root = tmp_path_factory.mktemp("digest")
    return str(root), write_checkpoint(str(root / "ck"), layers=2, experts=4, shards=2, seed=7)


def local(src, path):
    return local_digest(path, src.describe(), src.layout_of)


def test_safetensors_digest_is_the_local_one_read_once_and_bounded(ck, tmp_path):
    _, path = ck
    state = str(tmp_path / "state")
    src = open_source(path, DEFAULT_PATTERN)
    try:
        d = for_source(src, state, threads=2)
        assert not d["cached"]
        assert d["bytes_read"] == sum(sampled_bytes(s.nbytes) for k in src.keys for s in src.layout_of(k[0]))
        assert d["bytes_read"] <= len(src.keys) * len(src.layout) * BLOCK * BLOCKS
        assert local(src, path)["hex"] == d["hex"]
    finally:
        src.close()
    src = open_source(path, DEFAULT_PATTERN)                 # a restart on the same files reads nothing
    try:
        again = for_source(src, state, threads=2)
        assert again["cached"] and again["bytes_read"] == 0 and again["hex"] == d["hex"]
    finally:
        src.close()
    kept = [n for n in os.listdir(state) if n.startswith("digest-")]
    assert len(kept) == 1
    other = write_checkpoint(str(tmp_path / "other"), layers=2, experts=4, shards=1, seed=8)
    src = open_source(other, DEFAULT_PATTERN)       # another checkpoint's start keeps this one's digest
    try:
        for_source(src, state, threads=2)
    finally:
        src.close()
    assert set(kept) < set(os.listdir(state))


def test_a_changed_file_is_computed_again(tmp_path):
    path = write_checkpoint(str(tmp_path / "ck"), layers=2, experts=4, shards=2, seed=9)
    state = str(tmp_path / "state")
    src = open_source(path, DEFAULT_PATTERN)
    try:
        before = for_source(src, state, threads=2)
        e = src.keys[(1, 2)][0]
        target = src.files[e.file]
    finally:
        src.close()
    with open(target, "r+b") as f:                 # one byte of expert (1, 2)'s first tensor, in place
        f.seek(e.offset)
        b = f.read(1)
        f.seek(e.offset)
        f.write(bytes([b[0] ^ 0xFF]))
    src = open_source(path, DEFAULT_PATTERN)
    try:
        after = for_source(src, state, threads=2)
        assert not after["cached"] and after["hex"] != before["hex"]
        # the old file's digest can never be used again: pruned; the new one kept
        assert len([n for n in os.listdir(state) if n.startswith("digest-")]) == 1
        assert local(src, path)["hex"] == after["hex"]
        assert first_difference(before, after).startswith("layer 1 tensor ")
    finally:
        src.close()


def test_a_pack_has_its_sources_digest_and_the_client_reads_packs(ck):
    root, path = ck
    src = open_source(path, DEFAULT_PATTERN)
    pack = os.path.join(root, "ck.k3pack")
    try:
        want = for_source(src, "", threads=2)["hex"]
        write_pack(src, pack, progress=False)
    finally:
        src.close()
    p = open_source(pack, DEFAULT_PATTERN)
    try:
        assert for_source(p, "", threads=2)["hex"] == want
        assert local(p, pack)["hex"] == want
        assert local(p, path)["hex"] == want          # the safetensors dir the pack was made from
    finally:
        p.close()


def test_gguf_digest_matches_the_local_file_and_tells_other_values(tmp_path):
    a = write_synthetic_gguf(str(tmp_path / "a.gguf"), layers=2, experts=4, seed=3)
    b = write_synthetic_gguf(str(tmp_path / "b.gguf"), layers=2, experts=4, seed=4)
    src = open_source(a, DEFAULT_PATTERN)
    try:
        served = for_source(src, "", threads=2)
        assert local(src, a)["hex"] == served["hex"]
        other = local(src, b)
        assert other["hex"] != served["hex"]
        assert "holds other bytes" in first_difference(served, other)
    finally:
        src.close()


def test_http_source_has_the_local_digest(ck, tmp_path):
    root, path = ck
    binary = nginx_binary()
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("nginx is not installed in CI: .ci/run must apt-get install nginx-light")
        pytest.skip("nginx is not installed and cannot be installed here (apt-get install -y nginx-light)")
    state = str(tmp_path / "state")
    with Nginx(root, binary) as n:
        src = open_source(n.url + "ck/", DEFAULT_PATTERN)
        try:
            d = for_source(src, state, threads=2)
            assert d["hex"] == local(src, path)["hex"] and not d["cached"]
        finally:
            src.close()
        src = open_source(n.url + "ck/", DEFAULT_PATTERN)    # same URL, same ETags: from the state dir
        try:
            assert for_source(src, state, threads=2)["cached"]
        finally:
            src.close()


def test_s3_source_has_the_local_digest(ck):
    boto3 = pytest.importorskip("boto3")
    pytest.importorskip("moto.server")
    _, path = ck
    with moto_s3():
        client = boto3.client("s3")
        client.create_bucket(Bucket="k3d-digest")
        for f in os.listdir(path):
            client.upload_file(os.path.join(path, f), "k3d-digest", f"m/{f}")
        src = open_source("s3://k3d-digest/m/", DEFAULT_PATTERN)
        try:
            assert for_source(src, "", threads=2)["hex"] == local(src, path)["hex"]
        finally:
            src.close()


def test_a_user_pattern_is_the_clients_rule_too(tmp_path):
    """``--pattern`` names no family the client could guess: the daemon's pattern is followed."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(5)
    path = str(tmp_path / "odd.safetensors")
    save_file({f"net.{l}.ffn.{e}.{n}": rng.standard_normal((64, 96)).astype(np.float16)
               for l in range(2) for e in range(3) for n in ("wi", "wo")}, path)
    src = open_source(path, "net.{layer}.ffn.{expert}.{name}")
    try:
        assert local(src, path)["hex"] == for_source(src, "", threads=2)["hex"]
    finally:
        src.close()
