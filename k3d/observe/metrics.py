"""Prometheus ``/metrics`` (``--metrics HOST:PORT``), served by ``prometheus_client``.

Threads and ownership: the store, the policy and every counter belong to the
server thread.  A scrape runs on the exporter's HTTP thread and never touches
them: it asks the loop for a snapshot (``SnapshotBoard.request``: set a flag,
wake the loop) and waits for the loop to publish one (``publish``, called by
the loop between two requests with exactly the dict ``status`` returns).  So a
scrape shows the same values ``k3ctl status --json`` would at that moment.

A scrape never hangs: the wait is bounded (``WAIT_S``; then the last published
snapshot is served), and ``close`` (the loop's shutdown) wakes every waiting
scrape, which gets the last snapshot; after ``Exporter.stop`` the port is
closed, so a later scrape gets a refused connection.

Metric names follow Prometheus conventions: ``k3d_<name>_total`` for the
status counters (``stats``), gauges for the arena and clients, the histogram
``k3d_fetch_seconds{result=hit|miss|waited}``, and ``k3d_origin_*`` /
``k3d_disk_*`` for the remote tiers.  Every numeric field of ``stats`` is
exported, so counters added to status appear here without a change.

The caller's obligations: the server thread calls ``board.wanted`` (a plain
attribute read) once per loop turn and ``publish`` when it is set, and
``close`` when it stops serving.
"""

from __future__ import annotations

import threading

WAIT_S = 2.0      # a scrape waits at most this long for the loop (busy or stopping)

HELP = {
    "fetches": "fetch requests answered or parked",
    "hits": "fetched keys found resident or being read (each fetched key is one hit or one miss)",
    "misses": "fetched keys that had to be read from the source",
    "waited": "hits that were still being read (a prediction's or another client's read)",
    "evictions": "ready slots evicted to make room",
    "bytes_read": "bytes read from the source into the arena",
    "read_seconds": "seconds reader threads spent reading (summed over threads)",
    "prefetched": "background reads started for predictions",
    "prefetch_hits": "predictions fetched before the predictor's next token",
    "prefetch_unused": "predictions never fetched (demoted or evicted)",
    "prefetch_unused_bytes": "bytes read for predictions never fetched",
    "prefetch_refused": "predictions not read: the only victim was expected to be reused sooner",
    "loading_skips": "victims skipped because still loading (0: the run replays exactly)",
    "warm_loaded": "reads a warm restart queued for the saved hot set",
    "errors": "failed expert reads",
    "bad_requests": "requests refused as malformed, unknown or out of protocol",
    "requests_over_cap": "requests refused because their client already had the most requests waiting "
                         "(it was not waiting for replies; in bad_requests too)",
    "cache_full": "fetches refused because every slot was pinned",
    "clients_dead": "clients dropped because they exited or went silent",
    "paced": "times a client using far more than its share of the daemon's CPU was held back",
    "paced_seconds": "seconds clients were held back for using far more than their CPU share",
    "client_hits": "hits clients answered themselves from the shared index (reported later; in hits)",
    "late_hits": "client hits reported after the key had left its slot (the slot waited for reuse)",
    "bad_reports": "reported hits refused: slots the client could not have read in its window, or over its pin quota",
    "slots_busy": "fetches told to retry: the slots they needed waited until other clients' views ended",
    "evicted_ahead": "evictions made ahead of misses while several clients answer hits themselves",
    "layers_done": "layers clients released mid-token, their compute done (protocol 6 done)",
    "pins_done": "pins those layer releases dropped before their clients' next token",
    "replies_dropped": "replies not sent as they were: the client's queue was full (it is not reading), "
                       "or the reply could not be encoded (an error reply went instead)",
}
ARENA_GAUGES = {   # metric name: (status arena field, help)
    "k3d_arena_slots": ("slots", "slots in the arena"),
    "k3d_arena_used_slots": ("used", "slots holding an expert or being read"),
    "k3d_arena_pinned_slots": ("pinned", "slots pinned by some client's current token or outstanding prediction"),
    "k3d_arena_loading_slots": ("loading", "slots being read"),
    "k3d_arena_reuse_waiting_slots": ("reuse_waiting", "evicted slots waiting until no client can read them"),
    "k3d_arena_bytes": ("bytes", "bytes of arena"),
}
ORIGIN = {"fetches": "experts fetched from the origin", "bytes": "bytes fetched from the origin",
          "requests": "HTTP/S3 requests sent to the origin", "retries": "origin requests retried",
          "errors": "origin fetches that failed after their retries",
          "seconds": "seconds spent fetching from the origin (summed over readers)"}
DISK = {"hits": "experts served from the disk tier", "writes": "experts written to the disk tier",
        "evictions": "disk tier entries evicted (LRU)", "corrupt": "disk tier entries found corrupt"}
DISK_GAUGES = {"entries": "entries in the disk tier", "bytes": "bytes in the disk tier",
               "limit": "bytes the disk tier may hold"}


class SnapshotBoard:
    """Where the server loop publishes status snapshots for other threads."""

    def __init__(self, wake=None):
        self._cond = threading.Condition()
        self.wake = wake             # set by the server: makes its loop's poll return (None: no loop yet)
        self._seq = 0
        self._snapshot: dict | None = None
        self._closed = False
        self.wanted = False          # read by the loop each turn (no lock: a stale read costs one turn)

    def publish(self, status: dict) -> None:
        """Server thread: hand over a fresh status dict (not used by the loop afterwards)."""
        with self._cond:
            self._snapshot = status
            self._seq += 1
            self.wanted = False
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def request(self, timeout: float = WAIT_S) -> dict | None:
        """Any thread: a snapshot published after this call, or the last one if the loop does not
        answer within ``timeout`` or has stopped (None if none was ever published)."""
        with self._cond:
            if self._closed or self.wake is None:     # stopped, or still starting: nothing to wait for
                return self._snapshot
            seq = self._seq
            self.wanted = True
            self.wake()
            self._cond.wait_for(lambda: self._seq != seq or self._closed, timeout)
            return self._snapshot


def parse_hostport(text: str) -> tuple[str, int]:
    """``HOST:PORT`` / ``[v6]:PORT`` / ``:PORT`` -> (host, port); ValueError with what is accepted.
    Without a host only this machine may scrape (127.0.0.1): status names clients and models."""
    host, sep, port = str(text).rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:   # 0: any free port (logged)
        raise ValueError("use HOST:PORT, e.g. 127.0.0.1:9484")
    return host.strip("[]") or "127.0.0.1", int(port)


AUTO = {   # status prediction.daemon -> k3d_auto_prefetch_<field>_total
    "issued": "background reads the daemon's own predictor started",
    "used_in_time": "the daemon's predictions fetched after their read had finished",
    "used_late": "the daemon's predictions fetched while still being read (the fetch waited)",
    "unused": "the daemon's predictions nobody fetched before their client's next token",
    "unused_bytes": "bytes read for the daemon's predictions nobody fetched",
    "refused": "the daemon's predictions not read: the only victim was expected to be reused sooner",
}


def families(st: dict):
    """The metric families for one status dict (prometheus_client objects)."""
    # prometheus_client is the optional ``metrics`` extra: imported only when --metrics is used
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    starting = st.get("state") == "starting"
    yield GaugeMetricFamily("k3d_ready", "1 once the daemon serves, 0 while it starts", value=0 if starting else 1)
    if starting:
        done, total = st.get("done", 0), st.get("total", 0)
        yield GaugeMetricFamily("k3d_startup_progress_ratio", "share of the current start-up phase done",
                                value=done / total if total else 0.0)
        return
    for name, value in st["stats"].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            yield CounterMetricFamily(f"k3d_{name}", HELP.get(name, f"status stats.{name}"), value=value)
    a = st["arena"]
    for metric, (field, text) in ARENA_GAUGES.items():
        yield GaugeMetricFamily(metric, text, value=a[field])
    yield GaugeMetricFamily("k3d_clients", "attached clients", value=len(st["clients"]))
    r = st.get("readers", {})
    for field in ("queued_urgent", "queued_background", "held_back"):
        if field in r:
            yield GaugeMetricFamily(f"k3d_reads_{field}", f"reader parts {field.replace('_', ' ')}", value=r[field])
    yield GaugeMetricFamily("k3d_uptime_seconds", "seconds since the daemon started", value=st["uptime_s"])
    lat = st.get("fetch_seconds")
    if lat:
        h = HistogramMetricFamily("k3d_fetch_seconds", "seconds from a fetch's arrival to its reply, by its "
                                  "worst key (miss > waited > hit)", labels=["result"])
        for result in ("hit", "miss", "waited"):
            d = lat[result]
            buckets = [(repr(le), n) for le, n in zip(lat["le"], d["buckets"])] + [("+Inf", d["count"])]
            h.add_metric([result], buckets, d["sum"])
        yield h
    auto = (st.get("prediction") or {}).get("daemon")
    if auto:                                   # the daemon's own predictions (--predict auto)
        for field, text in AUTO.items():
            yield CounterMetricFamily(f"k3d_auto_prefetch_{field}", text, value=auto[field])
        yield CounterMetricFamily("k3d_auto_prefetch_cpu_seconds", "the daemon loop thread's CPU seconds in its own "
                                  "predictor: learning, proposing, starting its reads", value=auto["cpu_s"])
    tiers = (st.get("model") or {}).get("tiers") or {}
    o = tiers.get("origin")
    if o:
        for field, text in ORIGIN.items():
            if field in o:
                yield CounterMetricFamily(f"k3d_origin_{field}", text, value=o[field])
        if "up" in o:
            yield GaugeMetricFamily("k3d_origin_up", "1 while the origin answers, 0 while it does not",
                                    value=1 if o["up"] else 0)
    d = tiers.get("disk")
    if d:
        for field, text in DISK.items():
            if field in d:
                yield CounterMetricFamily(f"k3d_disk_{field}", text, value=d[field])
        for field, text in DISK_GAUGES.items():
            if field in d:
                yield GaugeMetricFamily(f"k3d_disk_{field}_bytes" if field == "limit" else f"k3d_disk_{field}",
                                        text, value=d[field])


REQUEST_TIMEOUT_S = 5.0   # a connection that sends no request is dropped after this


class _Collector:
    def __init__(self, board: SnapshotBoard):
        self.board = board

    def collect(self):
        st = self.board.request()
        if st is not None:
            yield from families(st)


class Exporter:
    """``/metrics`` on HOST:PORT in its own threads (prometheus_client's WSGI server)."""

    def __init__(self, hostport: str, board: SnapshotBoard):
        # prometheus_client is optional (pip install 'k3d-expert-cache[metrics]'): imported only with --metrics
        try:
            from prometheus_client import CollectorRegistry, start_http_server
        except ImportError:
            raise RuntimeError("--metrics needs prometheus_client: pip install 'k3d-expert-cache[metrics]'") from None
        host, port = parse_hostport(hostport)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(board))
        try:
            self._server, self._thread = start_http_server(port, host, registry)
        except OSError as e:
            raise RuntimeError(f"--metrics {hostport}: cannot listen ({e.strerror}); "
                               "pick another port or stop what uses it") from None
        # A scrape in flight at shutdown must end with a whole response, not be cut off when the
        # process exits under a daemon thread: make request threads joinable (server_close joins
        # them) and bound how long a silent connection can hold one.
        self._server.daemon_threads = False
        self._server.block_on_close = True
        self._server.RequestHandlerClass.timeout = REQUEST_TIMEOUT_S
        self.address = f"{host}:{self._server.server_port}"

    def stop(self) -> None:
        """Close the port; a scrape in progress finishes with the last snapshot (see SnapshotBoard.close)."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
