"""The family rules and per-layer layouts through every other route: HTTP, S3 and ``k3d pack``.

The remote sources parse header images with the same local parsers (and fetch
``config.json`` beside the checkpoint), so a stacked family and a mixed GGUF must
come out exactly as they do from local files: same family, same layouts per layer,
every expert byte equal to the local source's (itself checked against safe_open /
GGUFReader in tests/integration/test_families.py and test_gguf_mixes.py).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from test_gguf_mixes import _raw, _write

from faulty_http import FaultyServer
from helpers import moto_s3
from k3d.commands.pack import pack_main
from k3d.sources import open_source
from k3d.sources.remote.http import HttpSource
from k3d.sources.remote.s3 import S3Source
from tests import tiny_families as tf

pytest.importorskip("transformers")


def _mixed_gguf(path):
    rng = np.random.default_rng(2)
    t = {}
    for layer in range(2):
        down = T.Q6_K if layer == 0 else T.Q4_K
        t[f"blk.{layer}.ffn_down_exps.weight"] = (_raw(rng, down, (4, 256, 256)), down)
        t[f"blk.{layer}.ffn_up_exps.weight"] = (_raw(rng, T.Q4_K, (4, 256, 256)), T.Q4_K)
    return _write(path, t)


@pytest.fixture(scope="module")
def origin(tmp_path_factory):
    root = tmp_path_factory.mktemp("families-origin")
    for mt in ("gpt_oss", "jamba"):
        tf.write(mt, str(root / mt))
    _mixed_gguf(root / "mix.gguf")
    srv = FaultyServer(str(root)).start()
    yield srv, root
    srv.stop()


def _all_bytes(src) -> dict:
    out = {}
    for key in sorted(src.keys):
        slot = bytearray(-(-src.expert_bytes // 4096) * 4096)     # as the daemon sizes slots (packs read strides)
        src.read(src.keys[key], memoryview(slot))
        out[key] = bytes(slot[:max(s.offset + s.nbytes for s in src.layout_of(key[0]))])
    return out


def _same(remote, local) -> None:
    dr, dl = remote.describe(), local.describe()
    for k in ("family", "family_rule", "top_k", "layers", "tensor_format", "expert_bytes", "layouts"):
        assert dr.get(k) == dl.get(k), k
    assert {l: remote.layout_of(l) for l in dl["layers"]} == {l: local.layout_of(l) for l in dl["layers"]}
    assert _all_bytes(remote) == _all_bytes(local)


@pytest.mark.parametrize("what", ["gpt_oss/", "jamba/", "mix.gguf"])
def test_http_serves_families_and_mixes_as_local(origin, what):
    srv, root = origin
    remote = HttpSource(srv.url + what, None, timeout=5.0)
    local = open_source(str(root / what.rstrip("/")), None)
    try:
        if what.endswith("/"):
            assert remote.describe()["family"] == what.rstrip("/")
        else:
            assert not remote.uniform
        _same(remote, local)
    finally:
        remote.close()
        local.close()


def test_s3_serves_a_stacked_family(origin):
    boto3 = pytest.importorskip("boto3")
    pytest.importorskip("moto.server")
    _, root = origin
    with moto_s3():
        client = boto3.client("s3")
        client.create_bucket(Bucket="fam")
        for f in os.listdir(root / "gpt_oss"):
            client.upload_file(str(root / "gpt_oss" / f), "fam", f"gpt_oss/{f}")
        remote = S3Source("s3://fam/gpt_oss/", None)
        local = open_source(str(root / "gpt_oss"), None)
        try:
            assert remote.describe()["family"] == "gpt_oss"
            _same(remote, local)
        finally:
            remote.close()
            local.close()


@pytest.mark.parametrize("what", ["gpt_oss", "jamba", "mix.gguf"])
def test_pack_keeps_family_and_layouts(origin, what, tmp_path):
    _, root = origin
    out = str(tmp_path / "x.k3pack")
    assert pack_main(str(root / what), out, None, progress=False) == 0
    packed = open_source(out, None)
    local = open_source(str(root / what), None)
    try:
        assert packed.describe()["family"] == local.describe()["family"]
        for l in local.describe()["layers"]:
            assert packed.layout_of(l) == local.layout_of(l)
        assert packed.layer_tensor_types == local.layer_tensor_types
        assert _all_bytes(packed) == _all_bytes(local)
    finally:
        packed.close()
        local.close()
