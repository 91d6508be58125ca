"""Integration: ``--metrics`` serves Prometheus text equal to ``k3ctl status --json``."""

import json
import re
import signal
import socket
import threading
import urllib.error
import urllib.request

import pytest

import k3client
from helpers import k3ctl, k3d, poll_for

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


def k3ctl_json(endpoint):
    r = k3ctl("status", "--endpoint", endpoint, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def metrics_url(d):
    m = re.search(r"metrics at (http://\S+/metrics)", d.log())
    assert m, d.log()
    return m.group(1)


def scrape(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_scrape_equals_status(checkpoint, start_daemon):
    d = start_daemon(checkpoint, "--arena", "8MiB", "--metrics", "127.0.0.1:0")
    url = metrics_url(d)
    # through the daemon: the latency histogram is of the fetches the daemon answers
    with k3client.connect(d.endpoint, name="m", hit_path="daemon") as c:
        c.fetch(0, [0, 1])               # misses
        c.begin_token()
        c.fetch(0, [0, 1])               # hits
        c.predict([(1, 2)])
        poll_for(lambda: c.status()["arena"]["loading"] == 0, 10, "the prediction's read done")
        m = scrape(url)                  # the client is still attached
        st = k3ctl_json(d.endpoint)
    s = st["stats"]
    for name in ("hits", "misses", "waited", "evictions", "bytes_read", "prefetched", "prefetch_hits",
                 "prefetch_unused", "errors"):
        assert m[(f"k3d_{name}_total", ())] == s[name], name
    assert s["hits"] == 2 and s["misses"] == 2
    a = st["arena"]
    assert m[("k3d_arena_slots", ())] == a["slots"]
    assert m[("k3d_arena_used_slots", ())] == a["used"]
    assert m[("k3d_arena_pinned_slots", ())] == a["pinned"] == 3   # + the prediction, held until the next token
    assert m[("k3d_clients", ())] == 1          # status by k3ctl does not attach
    lat = st["fetch_seconds"]
    for result in ("hit", "miss", "waited"):
        assert m[("k3d_fetch_seconds_count", (("result", result),))] == lat[result]["count"]
        assert m[("k3d_fetch_seconds_sum", (("result", result),))] == pytest.approx(lat[result]["sum"])
    assert lat["hit"]["count"] == 1 and lat["miss"]["count"] == 1
    # the daemon's own predictor (--predict auto, the default) learned both fetches, at a CPU
    # cost timed in its loop thread; nothing ran it between the scrape and the status
    auto = st["prediction"]["daemon"]
    assert auto["fetches"] == 2 and auto["cpu_s"] > 0
    assert m[("k3d_auto_prefetch_cpu_seconds_total", ())] == pytest.approx(auto["cpu_s"])
    assert m[("k3d_auto_prefetch_issued_total", ())] == auto["issued"]
    line = next(ln for ln in k3ctl("status", "--endpoint", d.endpoint).stdout.splitlines() if ln.startswith("auto"))
    assert re.search(r"; \d+ us CPU per fetch$", line), line
    inf = m[("k3d_fetch_seconds_bucket", (("le", "+Inf"), ("result", "miss")))]
    assert inf == 1


def test_metrics_port_in_use_is_one_line(checkpoint, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        r = k3d("start", "--source", checkpoint, "--arena", "4MiB",
                "--endpoint", f"ipc://{tmp_path}/k.sock", "--metrics", f"127.0.0.1:{port}")
    assert r.returncode == 1
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert f"--metrics 127.0.0.1:{port}: cannot listen" in r.stderr


@pytest.mark.parametrize("value", ["9484", "host:port", "127.0.0.1:70000"])
def test_bad_metrics_address_is_one_line(checkpoint, tmp_path, value):
    r = k3d("start", "--source", checkpoint, "--arena", "4MiB", "--endpoint", f"ipc://{tmp_path}/k.sock",
            "--metrics", value)
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0 and "HOST:PORT" in r.stderr


def test_scrapes_during_shutdown_never_hang(checkpoint, start_daemon):
    d = start_daemon(checkpoint, "--arena", "8MiB", "--metrics", "127.0.0.1:0")
    url = metrics_url(d)
    outcomes, stop = [], threading.Event()

    def scraper():
        while not stop.is_set():
            try:
                scrape(url, timeout=20)
                outcomes.append("ok")
            except (urllib.error.URLError, ConnectionError, OSError) as e:
                # refused or closed: what a stopping exporter may answer; a timeout is a hang
                outcomes.append(f"hang: {e}" if "timed out" in str(e) else "closed")
            except Exception as e:   # a cut-off or malformed response: neither normal nor closed
                outcomes.append(f"bad: {e!r}")

    threads = [threading.Thread(target=scraper) for _ in range(4)]
    for t in threads:
        t.start()
    poll_for(lambda: outcomes.count("ok") >= 8, 60, lambda: f"eight good scrapes: {outcomes}")
    assert d.stop(signal.SIGTERM) == 0
    stop.set()
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    assert outcomes.count("ok") >= 8
    assert not [o for o in outcomes if o not in ("ok", "closed")], outcomes


def test_metrics_while_starting(checkpoint, start_daemon):
    d = start_daemon(checkpoint, "--arena", "2GiB", "--metrics", "127.0.0.1:0", wait_ready=False)
    def logged(text):
        assert d.proc.poll() is None, d.log()
        return text in d.log()

    poll_for(lambda: logged("metrics at"), 60, lambda: f"the metrics line:\n{d.log()}", interval=0.02)
    m = scrape(metrics_url(d))
    if m[("k3d_ready", ())] == 0:
        assert 0 <= m[("k3d_startup_progress_ratio", ())] <= 1
    poll_for(lambda: logged("k3d: ready"), 60, lambda: f"the ready line:\n{d.log()}", interval=0.05)
    m = scrape(metrics_url(d))
    assert m[("k3d_ready", ())] == 1 and ("k3d_hits_total", ()) in m
