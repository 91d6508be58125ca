"""Network edges against the real daemon: tcp endpoints stay on loopback unless the user
accepts the risk, ``--metrics :PORT`` listens on 127.0.0.1 only, and a client's name is
escaped in the daemon's log, in status and in ``k3ctl status``."""

import json
import re
import socket

import psutil
import pytest

import k3client
from helpers import k3ctl, k3d, poll_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("host", ["0.0.0.0", "*"])
def test_tcp_endpoint_beyond_loopback_is_refused_in_one_line(checkpoint, host):
    r = k3d("start", "--source", checkpoint, "--endpoint", f"tcp://{host}:{free_port()}", "--arena", "4MiB")
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0, r.stderr
    assert f"({host} is not a loopback address)" in r.stderr and "--allow-remote-tcp" in r.stderr


def test_loopback_tcp_endpoint_serves(checkpoint, start_daemon):
    d = start_daemon(checkpoint, "--slots", "4", endpoint=f"tcp://127.0.0.1:{free_port()}")
    with k3client.connect(d.endpoint, name="tcp") as c:
        assert c.fetch(0, [2])[0].array("w1.weight_scale").size > 0
    assert d.stop() == 0


def test_allow_remote_tcp_accepts_the_risk(checkpoint, start_daemon):
    port = free_port()
    d = start_daemon(checkpoint, "--slots", "4", "--allow-remote-tcp", endpoint=f"tcp://0.0.0.0:{port}")
    assert "is not ipc: peers have no credentials" in d.log()
    with k3client.connect(f"tcp://127.0.0.1:{port}", name="tcp") as c:
        assert c.fetch(0, [2])[0].array("w1.weight_scale").size > 0
    assert d.stop() == 0


def test_metrics_without_a_host_listen_on_loopback_only(checkpoint, start_daemon):
    pytest.importorskip("prometheus_client")
    d = start_daemon(checkpoint, "--slots", "4", "--metrics", ":0")
    m = re.search(r"metrics at http://127\.0\.0\.1:(\d+)/metrics", d.log())
    assert m, d.log()
    port = int(m.group(1))
    listening = [c.laddr for c in psutil.Process(d.pid).net_connections("inet")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    assert listening and all(a.ip == "127.0.0.1" for a in listening), listening
    assert d.stop() == 0


FORGED = "k3d: WARNING client root (pid 1) attached as #99"


def test_client_names_are_escaped_in_log_status_and_k3ctl(checkpoint, start_daemon):
    d = start_daemon(checkpoint, "--slots", "4")
    name = f"evil\n{FORGED}\r\x1b[2J\x07"
    shown = f"evil\\n{FORGED}\\r\\x1b[2J\\x07"
    with k3client.connect(d.endpoint, name=name) as c, k3client.connect(d.endpoint, name="plain") as other:
        c.fetch(0, [1])
        names = [x["name"] for x in other.status()["clients"]]
        assert shown in names and "plain" in names
        r = k3ctl("status", "--endpoint", d.endpoint)
        assert r.returncode == 0, r.stderr
        assert shown in r.stdout and "\x1b" not in r.stdout and "\x07" not in r.stdout
        r = k3ctl("status", "--endpoint", d.endpoint, "--json")
        assert shown in [x["name"] for x in json.loads(r.stdout)["clients"]]
    poll_for(lambda: f"client {shown} (pid" in d.log(), 10, d.log)
    log = d.log()
    assert not any(line.startswith(FORGED) for line in log.splitlines()), log
    assert "\x1b" not in log and "\r" not in log
    assert d.stop() == 0
