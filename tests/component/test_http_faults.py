"""HTTP source against the fault-injecting server: every fault gives a clear error or a retry, never wrong bytes.

Reads go through ``HttpSource.read`` in this process (as reader threads call it),
each expert split into parts like the server does; every byte read is compared
with ``safetensors.safe_open`` on the original files.  One test at the end
runs the real ``k3d start`` against the server.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

import k3client
from faulty_http import Fault, FaultyServer
from helpers import Reference, k3ctl
from k3d.config import DEFAULT_PATTERN
from k3d.demo.synthetic import write_checkpoint
from k3d.reads.plan import split_extents
from k3d.sources import SourceError
from k3d.sources.remote.http import HttpSource

SHARD1 = "model-00001-of-00002.safetensors"


@pytest.fixture(scope="module")
def origin(tmp_path_factory):
    root = tmp_path_factory.mktemp("origin")
    write_checkpoint(str(root / "ck"), layers=2, experts=4, shards=2, seed=11)
    write_checkpoint(str(root / "one"), layers=1, experts=2, shards=1, seed=12)
    srv = FaultyServer(str(root)).start()
    yield srv, root
    srv.stop()


@pytest.fixture
def server(origin):
    srv, root = origin
    srv.clear()
    srv.etags.clear()
    yield srv, root
    srv.clear()
    srv.etags.clear()
    srv.validators = True


@pytest.fixture(scope="module")
def ref(origin):
    return Reference(origin[1] / "ck")


def source(srv, path="ck/", **kw):
    kw.setdefault("timeout", 1.0)
    kw.setdefault("retries", 3)
    src = HttpSource(srv.url + path, DEFAULT_PATTERN, **kw)
    srv.clear()     # faults and the request log start after the headers were read
    return src


def read_expert(src, key, parts=1, threads=False) -> bytes:
    buf = bytearray(src.expert_bytes)
    slot = memoryview(buf)
    groups = split_extents(src.keys[key], parts)
    if threads:
        errs = []

        def run(g):
            try:
                src.read(g, slot)
            except Exception as e:     # re-raised below, in the test thread
                errs.append(e)
        ts = [threading.Thread(target=run, args=(g,)) for g in groups]
        [t.start() for t in ts]
        [t.join() for t in ts]
        if errs:
            raise errs[0]
    else:
        for g in groups:
            src.read(g, slot)
    return bytes(buf)


def ranged_gets(srv):
    return [r for r in srv.requests if r[0] == "GET" and r[2]]


def test_clean_reads_coalesced_if_match_persistent(server, ref):
    srv, _ = server
    src = source(srv, conns=2)
    srv.clear()
    for key in sorted(src.keys):
        ref.check(src, key, read_expert(src, key))
    gets = ranged_gets(srv)
    # one coalesced single-range request per expert, never multipart, always If-Match
    assert len(gets) == len(src.keys)
    assert all("," not in r[2] and r[3] and r[3].startswith('"v1-') for r in gets)
    assert len({r[4] for r in srv.requests}) <= 2        # persistent connections, at most --http-conns
    st = src.tier_stats()["origin"]
    assert st["fetches"] == len(src.keys) and st["retries"] == 0 and st["errors"] == 0
    src.close()


def test_parts_in_parallel_threads(server, ref):
    srv, _ = server
    src = source(srv, conns=3)
    for key in sorted(src.keys):
        ref.check(src, key, read_expert(src, key, parts=4, threads=True))
    assert src.tier_stats()["origin"]["fetches"] == len(src.keys)
    src.close()


def test_single_file_and_explicit_index(server, origin):
    srv, root = server
    one = source(srv, "one/")
    assert one.format == "safetensors" and len(one.keys) == 2 and one.files[0].endswith("one/model.safetensors")
    Reference(root / "one").check(one, (0, 1), read_expert(one, (0, 1)))
    one.close()
    idx = source(srv, "ck/model.safetensors.index.json")
    assert len(idx.keys) == 8
    idx.close()


def test_missing_source_is_clear(server):
    srv, _ = server
    with pytest.raises(SourceError, match="neither model.safetensors.index.json nor model.safetensors"):
        source(srv, "nothing/")
    with pytest.raises(SourceError, match="404"):
        source(srv, "ck/nope.safetensors")


def test_ignored_range_is_an_error_not_a_download(server, ref):
    srv, _ = server
    src = source(srv)
    srv.add(Fault("ignore_range", times=None))
    t0 = time.monotonic()
    with pytest.raises(SourceError, match=r"ignored the Range header \(200 OK"):
        read_expert(src, (0, 0))
    assert time.monotonic() - t0 < 5
    assert len(ranged_gets(srv)) == 1          # not retried: a 200 is a server that cannot do ranges
    srv.clear()
    ref.check(src, (0, 0), read_expert(src, (0, 0)))
    src.close()


@pytest.mark.parametrize("kind", ["truncate", "reset"])
def test_transient_body_and_connection_faults_are_retried(server, ref, kind):
    srv, _ = server
    src = source(srv)
    srv.clear()
    srv.add(Fault(kind, times=2))
    ref.check(src, (1, 2), read_expert(src, (1, 2)))
    st = src.tier_stats()["origin"]
    gets = ranged_gets(srv)
    assert len(gets) == 3 and st["errors"] == 0
    # a reset on a reused keep-alive connection looks like a stale one: one free retry, no backoff
    assert st["retries"] == (2 if kind == "truncate" else 1)
    if kind == "truncate":
        # a retry resumes after the bytes that did arrive (half the range each time)
        first, last = (int(x) for x in gets[0][2][6:].split("-")), gets[-1][2][6:].split("-")
        a0, b0 = first
        assert int(last[1]) == b0 and int(last[0]) > a0
    src.close()


@pytest.mark.parametrize("fault,match", [
    (Fault("truncate", times=None), "truncated body|IncompleteRead"),
    (Fault("reset", times=None), "Connection|reset|RemoteDisconnected"),
    (Fault("status", times=None, status=500), "HTTP 500"),
    (Fault("status", times=None, status=503), "HTTP 503"),
])
def test_persistent_faults_fail_with_url_and_status(server, ref, fault, match):
    srv, _ = server
    src = source(srv, retries=2)
    srv.add(fault)
    with pytest.raises(SourceError) as ei:
        read_expert(src, (0, 3))
    msg = str(ei.value)
    assert srv.url + "ck/" + SHARD1 in msg and "after 3 attempts" in msg
    assert __import__("re").search(match, msg), msg
    assert src.tier_stats()["origin"]["retries"] == 2
    srv.clear()
    ref.check(src, (0, 3), read_expert(src, (0, 3)))     # the next read retries and succeeds
    src.close()


def test_5xx_then_ok(server, ref):
    srv, _ = server
    src = source(srv)
    srv.add(Fault("status", times=1, status=503), Fault("status", times=1, status=500),
            Fault("status", times=1, status=429))
    ref.check(src, (1, 0), read_expert(src, (1, 0)))
    assert src.tier_stats()["origin"]["retries"] == 3
    src.close()


def test_404_is_not_retried(server):
    srv, _ = server
    src = source(srv)
    srv.clear()
    srv.add(Fault("status", times=None, status=404))
    with pytest.raises(SourceError, match="HTTP 404"):
        read_expert(src, (0, 0))
    assert len(ranged_gets(srv)) == 1
    src.close()


def test_stall_times_out_and_retries(server, ref):
    srv, _ = server
    src = source(srv, timeout=0.3)
    srv.add(Fault("stall", times=1, stall_s=1.5))
    ref.check(src, (0, 1), read_expert(src, (0, 1)))
    assert src.tier_stats()["origin"]["retries"] == 1
    srv.add(Fault("stall", times=None, stall_s=1.5))
    with pytest.raises(SourceError, match="timed out"):
        read_expert(src, (0, 2))
    src.close()


def test_trickling_body_times_out_as_a_whole(server, ref):
    """--http-timeout bounds the request, not each socket read: a body that keeps arriving,
    too slowly, is given up on (and retried), never waited on for ever."""
    srv, _ = server
    src = source(srv, timeout=0.5, retries=0)
    srv.add(Fault("trickle", times=None, stall_s=0.1))       # ~40 KB/s: each read is quick
    with pytest.raises(SourceError, match="arrived within the request timeout"):
        read_expert(src, (0, 1))
    srv.clear()
    ref.check(src, (0, 1), read_expert(src, (0, 1)))
    src.close()


def test_origin_without_validators_is_refused_unless_packed(server, ref):
    """No ETag and no Last-Modified: k3d could not tell a re-upload from the file it started
    with, so it refuses the checkpoint; a .k3pack (a crc32 per expert) is served anyway."""
    from k3d.sources import open_source
    from k3d.sources.packwrite import write_pack

    srv, root = server
    srv.validators = False
    with pytest.raises(SourceError, match="neither a strong ETag nor Last-Modified"):
        source(srv)
    local = open_source(str(root / "ck"), DEFAULT_PATTERN)
    write_pack(local, str(root / "ck.k3pack"), progress=False)
    local.close()
    src = source(srv, path="ck.k3pack")
    ref.check(src, (1, 3), read_expert(src, (1, 3)))
    src.close()


def test_shard_names_are_quoted_in_urls(server, ref, tmp_path):
    """Shard names are file names: a space, '#', '%' and non-ASCII go into the URL quoted."""
    import shutil

    srv, root = server
    d = root / "odd"
    if not d.exists():
        shutil.copytree(root / "ck", d)
        names = {"model-00001-of-00002.safetensors": "one shard #1 100%.safetensors",
                 "model-00002-of-00002.safetensors": "zwei-grüße.safetensors"}
        for old, new in names.items():
            (d / old).rename(d / new)
        idx = json.loads((d / "model.safetensors.index.json").read_text())
        idx["weight_map"] = {t: names[f] for t, f in idx["weight_map"].items()}
        (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    src = source(srv, path="odd/")
    for key in [(0, 0), (1, 3)]:
        ref.check(src, key, read_expert(src, key))
    assert {r[1] for r in ranged_gets(srv)} == {"odd/one shard #1 100%.safetensors", "odd/zwei-grüße.safetensors"}
    src.close()


@pytest.mark.parametrize("kind,match", [("bad_range", "Content-Range is 'bytes "),
                                        ("short_length", "Content-Length")])
def test_wrong_range_headers_are_errors(server, ref, kind, match):
    srv, _ = server
    src = source(srv)
    srv.add(Fault(kind, times=1))
    with pytest.raises(SourceError, match=match):
        read_expert(src, (1, 1))
    ref.check(src, (1, 1), read_expert(src, (1, 1)))
    src.close()


def test_changed_etag_mid_run_is_an_error_naming_the_file(server, ref):
    srv, _ = server
    src = source(srv)
    ref.check(src, (0, 0), read_expert(src, (0, 0)))
    srv.set_etag("ck/" + SHARD1, '"v2-reuploaded"')
    for _ in range(2):     # stays an error: never a mix of two versions
        with pytest.raises(SourceError) as ei:
            read_expert(src, (0, 1))
        assert "origin changed" in str(ei.value) and SHARD1 in str(ei.value) and "412" in str(ei.value)
    # the other shard is unchanged and still served
    ref.check(src, (1, 0), read_expert(src, (1, 0)))
    src.close()


def test_daemon_fetch_errors_then_recovers(server, ref, start_daemon):
    """The real ``k3d start``: a failing origin fails the fetch with URL and status; then it recovers."""
    srv, _ = server
    d = start_daemon(srv.url + "ck/", "--arena", "4MiB", "--http-retries", "1", "--http-timeout", "1",
                     "--readers", "2")
    with k3client.connect(d.endpoint, name="t") as c:
        srv.add(Fault("status", times=None, status=500, path=SHARD1))
        with pytest.raises(k3client.K3Error) as ei:
            c.fetch(0, [2])
        assert "HTTP 500" in str(ei.value) and SHARD1 in str(ei.value)
        srv.clear()
        c.begin_token()
        ex = c.fetch(0, [2, 3])
        for e in ex:
            for spec in c.layout:
                want = ref.expert(e.layer, e.expert, spec.name)
                assert e.array(spec.name).tobytes() == want.tobytes()
        st = c.status()
    tiers = st["model"]["tiers"]
    assert tiers["origin"]["fetches"] == 2 and tiers["origin"]["errors"] >= 1 and tiers["origin"]["retries"] >= 1
    r = k3ctl("status", "--endpoint", d.endpoint, "--json")
    assert json.loads(r.stdout)["model"]["kind"] == "http"
    assert d.stop() == 0


def test_bad_remote_header_names_the_url(server):
    srv, root = server
    bad = root / "bad"
    bad.mkdir(exist_ok=True)
    with open(bad / "model.safetensors", "wb") as f:
        f.write((40).to_bytes(8, "little") + b'{"x": {"dtype": "U8", "shape": [4], "data_' + bytes(100))
    with pytest.raises(SourceError) as ei:
        source(srv, "bad/")
    msg = str(ei.value)
    assert msg.startswith(srv.url + "bad/model.safetensors: header is not valid JSON"), msg
    assert "k3d-remote-hdr" not in msg


def test_gguf_header_longer_than_the_first_fetch(server, monkeypatch):
    """The GGUF header is fetched progressively until the parser sees all of it."""
    import k3d.sources.remote.headers as sh
    from k3d.demo.synthetic import write_synthetic_gguf
    from k3d.sources.gguf import GGUFSource
    srv, root = server
    write_synthetic_gguf(str(root / "m.gguf"), layers=2, experts=4, seed=5)
    monkeypatch.setattr(sh, "GGUF_HEAD_START", 64)
    remote = source(srv, "m.gguf")
    local = GGUFSource(str(root / "m.gguf"))
    assert remote.layout == local.layout and remote.keys == local.keys
    slot = memoryview(bytearray(remote.expert_bytes))
    want = bytearray(local.expert_bytes)
    remote.read(remote.keys[(1, 2)], slot)
    local.read(local.keys[(1, 2)], memoryview(want))
    for s in local.layout:
        assert slot[s.offset:s.offset + s.nbytes] == want[s.offset:s.offset + s.nbytes]
    remote.close()
    local.close()


def test_config_options():
    from k3d.config import ConfigError, resolve
    cfg = resolve({"http_conns": 8, "disk_cache": "dc", "disk_cache_size": "2GiB", "http_timeout": "2.5",
                   "http_retries": 0}, {})
    assert cfg.http_conns == 8 and cfg.disk_cache.endswith("/dc") and cfg.disk_cache_size == 2 * 2**30
    assert cfg.http_timeout == 2.5 and cfg.http_retries == 0
    assert resolve({}, {"K3D_HTTP_CONNS": "2"}).http_conns == 2
    for bad in ({"http_conns": 0}, {"disk_cache_size": "lots"}, {"http_retries": 99}, {"http_timeout": 0}):
        with pytest.raises(ConfigError, match=f"--{next(iter(bad)).replace('_', '-')}"):
            resolve(bad, {})


def test_direct_read_mode_is_refused_for_remote_sources(server):
    from k3d.sources import open_source
    srv, _ = server
    with pytest.raises(SourceError, match="--read-mode direct reads local packed files"):
        open_source(srv.url + "ck/", DEFAULT_PATTERN, "direct")
