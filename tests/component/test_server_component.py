"""Component: the real server loop on a real ipc socket, in a thread, with real clients.

Two wrappers around the real safetensors source stand in for what a local
disk cannot produce on demand: a slow read and a failing read.
"""

import dataclasses
import mmap
import os
import tempfile
import threading
import time
import warnings

import msgpack
import numpy as np
import psutil
import pytest
import zmq

import k3client
from conftest import SCRATCH
from helpers import ROOT, expert_bytes, poll_for
from k3client.protocol import PROTOCOL_VERSION, pack, unpack
from k3d.config import DEFAULT_PATTERN, resolve
from k3d.memory.arena import Arena
from k3d.observe.metrics import HELP
from k3d.observe.stats import Counters
from k3d.serve.loop import Server
from k3d.service.daemon import size_arena
from k3d.sources.safetensors import SafetensorsSource
from servers import Servers


class Faulty(SafetensorsSource):
    """The real source, with per-key delays and failures the test controls; ``started``
    lists the keys whose (delayed or failing) reads have begun, in order."""

    def __init__(self, *a):
        super().__init__(*a)
        self.delay, self.fail, self.started = {}, set(), []

    def key_of(self, extent):
        """The expert an extent (or a part cut from one) belongs to."""
        for key, exts in self.keys.items():
            if any(e.file == extent.file and e.offset <= extent.offset < e.offset + e.length for e in exts):
                return key

    def read(self, extents, slot):
        key = self.key_of(extents[0]) if (self.delay or self.fail) else None
        if key is not None:
            self.started.append(key)
        time.sleep(self.delay.get(key, 0))
        if key in self.fail:
            raise OSError(5, f"Input/output error (injected for {key})")
        return super().read(extents, slot)


@pytest.fixture
def server(checkpoint):
    servers = Servers(checkpoint, Faulty)
    yield servers.start
    servers.close()


def reference(srv, key):
    """The expert's bytes as laid out in a slot, from safetensors.safe_open."""
    return expert_bytes(srv.ref, srv.source.layout, key)


def test_fetch_returns_correct_bytes_zero_copy(server):
    srv = server()
    with k3client.connect(srv.cfg.endpoint, name="a") as c:
        ex = c.fetch(1, [3, 5, 7])
        assert [(e.layer, e.expert) for e in ex] == [(1, 3), (1, 5), (1, 7)]
        for e in ex:
            assert bytes(e.memory()) == reference(srv, (1, e.expert))
        a = ex[0].array("w1.weight_packed")
        assert a.shape == (256, 256) and not a.flags.writeable and not a.flags.owndata
        with pytest.raises(ValueError):
            a[0, 0] = 1
        try:
            import torch  # noqa: F401  (optional for k3d: this test runs without it)
        except ImportError:
            pass
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                t = ex[1].tensor("w2.weight_scale")
            assert np.array_equal(t.numpy(), ex[1].array("w2.weight_scale"))
        again = c.fetch(1, [5])
        assert again[0].slot == ex[1].slot
        st = c.status()
        assert st["stats"]["hits"] == 1 and st["stats"]["misses"] == 3


def test_arena_cannot_be_mapped_writable(server):
    import socket
    srv = server()
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.connect(srv.arena_socket)
        _, fds, _, _ = socket.recv_fds(s, 4096, 1)
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(fds[0], srv.arena.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(OSError):
            os.write(fds[0], b"x")
    finally:
        os.close(fds[0])


def test_cold_miss_does_not_delay_other_clients_hits(server):
    srv = server()
    srv.source.delay[(2, 9)] = 1.5
    with k3client.connect(srv.cfg.endpoint, name="fast") as fast, \
            k3client.connect(srv.cfg.endpoint, name="slow") as slow:
        fast.fetch(0, [1])
        done = {}
        th = threading.Thread(target=lambda: done.setdefault("slow", (slow.fetch(2, [9]), time.monotonic())))
        th.start()
        poll_for(lambda: (2, 9) in srv.source.started, 5, "the cold miss's read to start")
        t0 = time.monotonic()
        for _ in range(20):
            fast.begin_token()
            fast.fetch(0, [1])
        hits_done = time.monotonic()
        th.join(10)
        assert hits_done < done["slow"][1], "hits waited for the cold miss"
        assert hits_done - t0 < 1.0


def test_waiters_share_one_read_and_count_waited(server):
    srv = server()
    srv.source.delay[(3, 4)] = 0.5
    with k3client.connect(srv.cfg.endpoint, name="a") as a, k3client.connect(srv.cfg.endpoint, name="b") as b:
        res = {}
        th = threading.Thread(target=lambda: res.setdefault("a", a.fetch(3, [4])))
        th.start()
        poll_for(lambda: (3, 4) in srv.source.started, 5, "a's read to start")
        eb = b.fetch(3, [4])
        th.join(5)
        assert eb[0].slot == res["a"][0].slot
        st = b.status()["stats"]
        assert st["misses"] == 1 and st["hits"] == 1 and st["waited"] == 1


def test_failed_read_errors_every_waiter_then_retry_works(server):
    srv = server()
    srv.source.delay[(1, 1)] = 0.4
    srv.source.fail.add((1, 1))
    with k3client.connect(srv.cfg.endpoint, name="a") as a, k3client.connect(srv.cfg.endpoint, name="b") as b:
        errs = []

        def go(c):
            try:
                c.fetch(1, [1, 2])
            except k3client.ReadFailed as e:
                errs.append(str(e))

        ths = [threading.Thread(target=go, args=(c,)) for c in (a, b)]
        ths[0].start()
        poll_for(lambda: (1, 1) in srv.source.started, 5, "a's failing read to start")
        ths[1].start()                   # b waits on the same read
        for t in ths:
            t.join(5)
        assert len(errs) == 2 and all("(layer 1, expert 1)" in e and "next fetch retries" in e for e in errs)
        srv.source.fail.clear()
        a.begin_token()
        ex = a.fetch(1, [1])
        assert bytes(ex[0].memory()) == reference(srv, (1, 1))
        assert a.status()["stats"]["errors"] >= 1


def test_cache_full_names_pinned_and_total(server):
    srv = server(slots=4)
    with k3client.connect(srv.cfg.endpoint, name="a") as a, k3client.connect(srv.cfg.endpoint, name="b") as b:
        a.fetch(0, [0, 1, 2])
        with pytest.raises(k3client.CacheFull, match="3 of 4 slots pinned"):
            b.fetch(0, [3, 4])
        assert b.fetch(0, [3])[0].expert == 3
        a.begin_token()
        assert len(b.fetch(1, [0, 1, 2])) == 3     # a's pins are gone: evictable


def test_predict_then_unused_counts(server):
    srv = server(slots=8)
    with k3client.connect(srv.cfg.endpoint, name="p") as c:
        assert c.predict([(2, 1), (2, 2)]) == 2
        ex = c.fetch(2, [1])
        assert bytes(ex[0].memory()) == reference(srv, (2, 1))
        c.begin_token()
        st = c.status()["stats"]
        assert st["prefetched"] == 2 and st["prefetch_hits"] == 1 and st["prefetch_unused"] == 1
        assert st["hits"] == 1 and st["misses"] == 0


def raw_dealer(endpoint):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    return s


def ask(s, payload: bytes):
    s.send(payload)
    assert s.poll(1000), "no answer within 1 s"
    return unpack(s.recv())


@pytest.mark.parametrize("payload,code,words", [
    (b"\xc1\xff garbage", "bad_request", "not msgpack"),
    (msgpack.packb([1, 2, 3]), "bad_request", "must be a msgpack map"),
    (pack({"v": PROTOCOL_VERSION, "op": "fetch", "id": "x"}), "bad_request", "'id' must be an integer"),
    (pack({"v": PROTOCOL_VERSION, "op": "explode", "id": 1}), "bad_request", "unknown op 'explode'"),
    (pack({"v": 99, "op": "hello", "id": 1}), "version_mismatch", "protocol 99"),
    (pack({"v": PROTOCOL_VERSION, "op": "fetch", "id": 1, "keys": [[0, 1]]}), "not_attached", "hello first"),
])
def test_malformed_messages_get_one_line_errors(server, payload, code, words):
    srv = server()
    s = raw_dealer(srv.cfg.endpoint)
    r = ask(s, payload)
    assert r["ok"] is False and r["error"]["code"] == code and words in r["error"]["message"]
    assert "\n" not in r["error"]["message"]
    s.close()
    with k3client.connect(srv.cfg.endpoint, name="ok") as c:
        assert c.fetch(0, [0])[0].expert == 0


@pytest.mark.parametrize("keys,exc,words", [
    ([], k3client.BadRequest, "zero keys"),
    ([[0, 1], [0, 1]], k3client.BadRequest, "duplicate key (layer 0, expert 1)"),
    ([[0, 99]], k3client.UnknownExpert, "(layer 0, expert 99)"),
    ([[-1, 0]], k3client.UnknownExpert, "layers 0-3"),
    ([[0, "1"]], k3client.BadRequest, "pair of integers"),
    ([[0, True]], k3client.BadRequest, "pair of integers"),
    ("nope", k3client.BadRequest, "list of [layer, expert]"),
])
def test_bad_fetches_are_refused_and_nothing_changes(server, keys, exc, words):
    srv = server()
    with k3client.connect(srv.cfg.endpoint, name="bad") as c:
        with pytest.raises(exc) as ei:
            c._call("fetch", keys=keys)
        assert words in str(ei.value)
        st = c.status()
        assert st["arena"]["used"] == 0 and st["stats"]["hits"] + st["stats"]["misses"] == 0
        assert c.fetch(0, [2])[0].expert == 2


def test_bad_predicted_field_refuses_whole_fetch(server):
    srv = server()
    with k3client.connect(srv.cfg.endpoint, name="bad") as c:
        with pytest.raises(k3client.UnknownExpert):
            c.fetch(0, [1], predicted=[(0, 77)])
        assert c.status()["arena"]["used"] == 0


def test_status_has_the_documented_fields(server):
    srv = server()
    with k3client.connect(srv.cfg.endpoint, name="s") as c:
        c.fetch(0, [0])
        st = c.status()
    for k in ("version", "pid", "uptime_s"):
        assert k in st
    assert set(st["arena"]) >= {"bytes", "slots", "slot_bytes", "used", "pinned", "loading"}
    assert set(st["stats"]) >= {"hits", "misses", "waited", "prefetched", "prefetch_unused", "evictions",
                                "bytes_read", "errors"}
    [cl] = st["clients"]
    assert cl["name"] == "s" and cl["pid"] == os.getpid() and cl["epoch"] == 0 and cl["pins"] == 1
    _every_field_is_in_the_reference(st)


def _every_field_is_in_the_reference(st):
    """docs/reference/status.md names every field a real status has (the ``stats`` table there
    is generated from ``Counters`` and the metrics' ``HELP``, so those two must cover ``stats``)."""
    with open(os.path.join(ROOT, "docs", "reference", "status.md"), encoding="utf-8") as f:
        page = f.read()
    fields = set(st) | {f"arena.{k}" for k in st["arena"]} | {f"clients.{k}" for k in st["clients"][0]}
    fields |= {f"{section}.{k}" for section in ("readers", "reuse", "fetch_seconds", "model") for k in st[section]}
    missing = sorted(f for f in fields if f"`{f.rsplit('.', 1)[-1]}`" not in page)
    assert not missing, f"status fields docs/reference/status.md does not describe: {missing}"
    counters = {f.name for f in dataclasses.fields(Counters)} | set(HELP)
    assert not set(st["stats"]) - counters, set(st["stats"]) - counters


def test_not_running_is_a_clear_error(tmp_path):
    with pytest.raises(k3client.DaemonNotRunning, match="not running at ipc://"):
        k3client.connect(f"ipc://{tmp_path}/none.sock")


def test_fd_exhaustion_does_not_stop_the_loop(server):
    import resource
    import socket
    srv = server()
    with k3client.connect(srv.cfg.endpoint, name="a") as c:
        hog = []
        try:
            try:
                while len(hog) < resource.getrlimit(resource.RLIMIT_NOFILE)[0]:
                    hog.append(os.open("/dev/null", os.O_RDONLY))
            except OSError:
                pass
            os.close(hog.pop())          # room for the connecting socket only
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(srv.arena_socket)  # the server's accept() now fails with EMFILE
            # Nothing to poll: the loop must meet the failing accept() while the fds are gone.
            time.sleep(0.3)
        finally:
            for fd in hog:
                os.close(fd)
        s.close()
        assert srv.thread.is_alive()
        assert c.fetch(0, [1])[0].expert == 1


def test_pipelined_begin_token_still_gets_pinned_slots(server):
    """A raw client sends begin_token before its deferred fetch is answered."""
    srv = server(slots=4)
    srv.source.delay[(1, 2)] = 0.4
    s = raw_dealer(srv.cfg.endpoint)
    assert ask(s, pack({"v": PROTOCOL_VERSION, "op": "hello", "id": 1, "name": "pipe"}))["ok"]
    s.send(pack({"v": PROTOCOL_VERSION, "op": "fetch", "id": 2, "keys": [[1, 2]]}))
    s.send(pack({"v": PROTOCOL_VERSION, "op": "begin_token", "id": 3}))
    replies = {}
    for _ in range(2):
        assert s.poll(3000)
        r = unpack(s.recv())
        replies[r["id"]] = r
    assert replies[3]["epoch"] == 1 and replies[2]["ok"]
    with k3client.connect(srv.cfg.endpoint, name="obs") as o:
        st = o.status()
    pipe = next(c for c in st["clients"] if c["name"] == "pipe")
    assert pipe["epoch"] == 1 and pipe["pins"] == 1 and st["arena"]["pinned"] == 1
    s.close()


def test_shutdown_with_reads_in_flight_answers_shutting_down(checkpoint):
    tmp = tempfile.mkdtemp(prefix="k3d-c-", dir=SCRATCH)
    cfg = resolve({"endpoint": f"ipc://{tmp}/k.sock", "slots": 8, "readers": 1, "state_dir": "none"}, {})
    src = Faulty(checkpoint, DEFAULT_PATTERN)
    src.delay = {(0, i): 0.3 for i in range(4)}
    n, sb = size_arena(cfg, src.expert_bytes)
    arena = Arena(n, sb)
    srv = Server(cfg, src, arena, f"{tmp}/k.sock.arena")
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        s = raw_dealer(cfg.endpoint)
        assert ask(s, pack({"v": PROTOCOL_VERSION, "op": "hello", "id": 1, "name": "w"}))["ok"]
        s.send(pack({"v": PROTOCOL_VERSION, "op": "fetch", "id": 2, "keys": [[0, 0], [0, 1], [0, 2], [0, 3]]}))
        poll_for(lambda: src.started, 5, "the fetch's first read to start")
        srv.request_stop()
        assert s.poll(5000)
        r = unpack(s.recv())
        assert r["ok"] is False and r["error"]["code"] == "shutting_down", r
        t.join(10)
        assert not t.is_alive() and srv.stats.errors == 0
        s.close()
    finally:
        srv.request_stop()
        t.join(10)
        arena.close()
        src.close()


def test_closed_client_raises_a_typed_error(server):
    srv = server()
    c = k3client.connect(srv.cfg.endpoint, name="c")
    c.close()
    c.close()
    with pytest.raises(k3client.K3Error, match="closed"):
        c.fetch(0, [0])


def _hello(s, name):
    assert ask(s, pack({"v": PROTOCOL_VERSION, "op": "hello", "id": 1, "name": name}))["ok"]


def _replies(s, n, wait_ms=5000):
    out = {}
    for _ in range(n):
        assert s.poll(wait_ms), f"only {len(out)} of {n} replies"
        r = unpack(s.recv())
        out[r["id"]] = r
    return out


def test_fetch_answered_after_begin_token_stays_within_the_quota(server):
    """A pipelining client's late fetch is pinned in the new token only within its quota."""
    srv = server(slots=8, pin_quota=2)
    srv.source.delay[(1, 2)] = srv.source.delay[(1, 3)] = 0.4
    s = raw_dealer(srv.cfg.endpoint)
    _hello(s, "pipe")
    s.send(pack({"v": PROTOCOL_VERSION, "op": "fetch", "id": 2, "keys": [[1, 2], [1, 3]]}))
    s.send(pack({"v": PROTOCOL_VERSION, "op": "begin_token", "id": 3}))
    s.send(pack({"v": PROTOCOL_VERSION, "op": "fetch", "id": 4, "keys": [[0, 0]]}))
    r = _replies(s, 3)
    assert r[3]["ok"] and r[4]["ok"]
    assert not r[2]["ok"] and r[2]["error"]["code"] == "quota_exceeded", r[2]
    assert "would pin 3 slots in the new token, the quota is 2" in r[2]["error"]["message"]
    with k3client.connect(srv.cfg.endpoint, name="obs") as o:
        pipe = next(c for c in o.status()["clients"] if c["name"] == "pipe")
    assert pipe["epoch"] == 1 and pipe["pins"] == 1
    s.close()


def test_client_dropped_while_its_fetch_waits_is_told_at_once(server):
    """A live client whose lease ran out (stopped, swapped out) while its fetch waits on a
    read gets a not_attached error then, not silence until its own timeout."""
    srv = server(slots=8, lease_s=0.3)
    srv.source.delay[(2, 5)] = 2.5
    s = raw_dealer(srv.cfg.endpoint)         # a raw client: it sends no heartbeats
    _hello(s, "sleepy")
    s.send(pack({"v": PROTOCOL_VERSION, "op": "fetch", "id": 2, "keys": [[2, 5]]}))
    r = _replies(s, 1, wait_ms=2000)[2]      # before the read ends (2.5 s): told at the drop
    assert not r["ok"] and r["error"]["code"] == "not_attached"
    assert "dropped this client (silent for" in r["error"]["message"]
    s.close()


def test_dead_clients_held_back_reads_do_not_jump_the_queue(server):
    """The held-back part of a big cold fetch whose client leaves goes to the background
    queue: another client's miss is not put behind it, and fetching one of its keys
    promotes that read."""
    srv = server(slots=32, readers=1)         # fair share: 2 jobs in the pool at a time
    for e in range(12):
        srv.source.delay[(2, e)] = 0.3
    a = raw_dealer(srv.cfg.endpoint)
    _hello(a, "big")
    a.send(pack({"v": PROTOCOL_VERSION, "op": "fetch", "id": 2, "keys": [[2, e] for e in range(12)]}))
    with k3client.connect(srv.cfg.endpoint, name="small") as b:
        poll_for(lambda: b.status()["readers"]["queued_urgent"] >= 1, 3, "the big fetch's reads to queue")
        a.send(pack({"v": PROTOCOL_VERSION, "op": "bye", "id": 3}))
        r = _replies(a, 2)                    # bye, and the fetch it left: not_attached
        assert r[3]["ok"] and r[2]["error"]["code"] == "not_attached"
        q = b.status()["readers"]
        assert q["queued_background"] >= 8 and q["queued_urgent"] <= 1, q
        exs = b.fetch(3, [7])                 # a miss of its own: urgent, ahead of the 8+
        assert bytes(exs[0].memory()[:srv.source.expert_bytes]) == reference(srv, (3, 7))
        q = b.status()["readers"]
        assert q["queued_background"] >= 6, q
        b.begin_token()
        exs = b.fetch(2, [11])                # one of the big fetch's keys: promoted, served
        assert bytes(exs[0].memory()[:srv.source.expert_bytes]) == reference(srv, (2, 11))
        assert b.status()["readers"]["queued_background"] >= 4
    a.close()


def test_start_ticks_reads_proc_stat_even_with_odd_process_names(tmp_path):
    """The clock-step-proof start time of a process, parsed past a comm holding ') ('."""
    import subprocess
    import sys

    from k3d.cache.sessions import start_ticks

    odd = tmp_path / "a) b (c"
    odd.symlink_to(sys.executable)
    p = subprocess.Popen([str(odd), "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        ticks = start_ticks(p.pid)
        with open(f"/proc/{p.pid}/stat") as f:
            assert "(a) b (c)" in f.read()
        hz = os.sysconf("SC_CLK_TCK")
        want = (psutil.Process(p.pid).create_time() - psutil.boot_time()) * hz
        assert isinstance(ticks, int) and abs(ticks - want) <= 1
        p.stdin.close()                               # it exits; not reaped yet: a zombie
        poll_for(lambda: start_ticks(p.pid) is None, 5, "a zombie to read as gone")
        with open(f"/proc/{p.pid}/stat") as f:
            stat = f.read()
        assert stat[stat.rindex(")") + 2:].startswith("Z")
    finally:
        p.communicate()
    assert start_ticks(p.pid) is None                 # exited and reaped


def test_predicting_then_fetching_stays_within_the_fair_share(server):
    """Predicted reads a client then waits for are metered like its misses: predicting a
    big batch and fetching it is no way around the fair share of the readers."""
    srv = server(slots=32, readers=1)         # fair share: 2 urgent jobs in the pool at a time
    for e in range(12):
        srv.source.delay[(2, e)] = 0.2
    with k3client.connect(srv.cfg.endpoint, name="greedy") as a, \
            k3client.connect(srv.cfg.endpoint, name="other") as b:
        a.predict([(2, e) for e in range(12)])
        t = threading.Thread(target=a.fetch, args=(2, list(range(12))))
        t.start()
        poll_for(lambda: b.status()["readers"]["held_back"] >= 8, 3, lambda: f"8 held back: {b.status()['readers']}")
        q = b.status()["readers"]
        assert q["queued_urgent"] <= 2 and q["queued_background"] == 0, q
        exs = b.fetch(3, [7])                 # ahead of the greedy client's held-back reads
        assert bytes(exs[0].memory()[:srv.source.expert_bytes]) == reference(srv, (3, 7))
        assert b.status()["readers"]["held_back"] >= 4
        t.join(10)
        assert not t.is_alive()
