"""systemd integration: the units, the notify protocol over a real socket, SIGHUP reload.

The notify tests bind an AF_UNIX datagram socket, point NOTIFY_SOCKET (and
WATCHDOG_USEC) at it and run the real ``k3d start``: what systemd would
receive is recorded with arrival times and checked against the daemon's
state at that moment (READY=1 only once both sockets exist).
"""

import os
import signal
import socket
import subprocess
import tempfile
import threading
import time

import pytest

import k3client
from conftest import SCRATCH
from helpers import ROOT, k3d, poll_for
from k3d.config import Config
from k3d.service import units


# -- units ---------------------------------------------------------------------
def test_repo_unit_files_are_the_embedded_ones():
    """systemd/* are what `k3d install-unit --exec /usr/local/bin/k3d --arena 512MiB` writes."""
    for name in units.FILES:
        with open(os.path.join(ROOT, "systemd", name)) as f:
            assert f.read() == units.render(name, units.EXAMPLE_EXEC, Config().arena), name


@pytest.mark.parametrize("name", ["k3d.service", "k3d@.service"])
def test_unit_settings(name):
    text = units.render(name, "/usr/bin/k3d", 64 * 2**30)
    lines = set(text.splitlines())
    for want in ("Type=notify", "User=k3d", "Group=k3d", "RuntimeDirectoryMode=0750", "WatchdogSec=30",
                 "ExecReload=/bin/kill -HUP $MAINPID", "RemoveIPC=no", "NoNewPrivileges=yes",
                 "ProtectSystem=strict", "ReadWritePaths=-/dev/shm",
                 f"MemoryMax={64 * 1024 + 2048}M"):
        assert want in lines, want
    assert "DynamicUser=yes" not in lines and "RemoveIPC=yes" not in lines
    assert not any(l.startswith(("ProtectProc=", "ProcSubset=")) for l in lines)   # /proc must stay visible
    if name == "k3d.service":
        assert "ExecStart=/usr/bin/k3d start --config /etc/k3d/k3d.toml" in lines
        assert "RuntimeDirectory=k3d" in lines
        assert "RuntimeDirectoryPreserve=yes" in lines        # k3d@MODEL sockets live below /run/k3d
        assert "Environment=K3D_ENDPOINT=ipc:///run/k3d/k3d.sock" in lines
    else:
        assert "ExecStart=/usr/bin/k3d start --config /etc/k3d/%i.toml" in lines
        assert "RuntimeDirectory=k3d/%i" in lines
        assert "Environment=K3D_ENDPOINT=ipc:///run/k3d/%i/k3d.sock" in lines


def test_install_unit_print_and_dest(tmp_path):
    cfg = tmp_path / "k3d.toml"
    cfg.write_text('arena = "4GiB"\nsource = "/srv/model"\n')
    r = k3d("install-unit", "--print", "--config", str(cfg), "--exec", "/opt/k3d/bin/k3d")
    assert r.returncode == 0, r.stderr
    assert "# ---- k3d.service" in r.stdout and "# ---- k3d@.service" in r.stdout
    assert f"MemoryMax={4 * 1024 + 2048}M" in r.stdout
    assert "ExecStart=/opt/k3d/bin/k3d start --config /etc/k3d/%i.toml" in r.stdout
    assert not list(tmp_path.glob("*.service"))
    dest = tmp_path / "units"
    r = k3d("install-unit", "--dest", str(dest), "--arena", "1GiB", "--config", "/nonexistent")
    assert r.returncode == 1 and "--config /nonexistent: no such file" in r.stderr   # a typo is not ignored
    r = k3d("install-unit", "--dest", str(dest), "--arena", "1GiB")
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(dest)) == sorted(units.FILES)
    text = (dest / "k3d.service").read_text()
    assert f"MemoryMax={1024 + 2048}M" in text
    cfg.write_text('slots = 2000\nsource = "/srv/model"\n')   # sized by slots: MemoryMax needs --arena
    r = k3d("install-unit", "--print", "--config", str(cfg))
    assert r.returncode == 1 and "sizes the arena by slots (2000); MemoryMax needs bytes: pass --arena" in r.stderr
    r = k3d("install-unit", "--print", "--config", str(cfg), "--arena", "8GiB", "--exec", "/root/venv/bin/k3d")
    assert r.returncode == 0 and f"MemoryMax={8 * 1024 + 2048}M" in r.stdout
    if os.stat("/root").st_mode & 0o001 == 0:
        assert "warning: ExecStart /root/venv/bin/k3d is under /root, which other users cannot enter" in r.stderr
    assert (os.stat(dest / "k3d.service").st_mode & 0o777) == 0o644
    # the default ExecStart is this installation's k3d (or python -m k3d)
    assert f"ExecStart={units.default_exec()} start" in text
    r = k3d("install-unit", "--print", "--arena", "lots")
    assert r.returncode == 1 and "not a size" in r.stderr


@pytest.mark.parametrize("folder", ["/tmp", "/var/tmp"])
def test_an_exec_start_in_the_services_private_tmp_is_warned_of(folder):
    """PrivateTmp=yes shows the service an empty /tmp and /var/tmp: a k3d installed there is not found."""
    r = k3d("install-unit", "--print", "--arena", "1GiB", "--exec", f"{folder}/venv/bin/k3d")
    assert r.returncode == 0 and "PrivateTmp=yes" in r.stdout
    warnings = [ln for ln in r.stderr.splitlines() if "ExecStart" in ln]
    assert warnings == [f"k3d: warning: ExecStart {folder}/venv/bin/k3d is under {folder}, which the unit's "
                        "PrivateTmp=yes replaces with an empty directory for the service: it could not start; "
                        "install k3d elsewhere (e.g. a venv under /opt) and pass --exec"], r.stderr
    r = k3d("install-unit", "--print", "--arena", "1GiB", "--exec", "/opt/k3d/bin/k3d")
    assert r.returncode == 0 and "ExecStart" not in r.stderr


def test_units_pass_systemd_analyze_verify(tmp_path):
    if not os.path.exists("/usr/bin/systemd-analyze"):
        pytest.skip("systemd-analyze not installed")
    for name in ("k3d.service", "k3d@.service"):
        (tmp_path / name).write_text(units.render(name, "/bin/true", 2**30))
    (tmp_path / "k3d@m.service").write_text(units.render("k3d@.service", "/bin/true", 2**30))
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(tmp_path / "k3d.service"),
                        str(tmp_path / "k3d@m.service")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


# -- notify protocol ---------------------------------------------------------------
class NotifySocket:
    """What systemd would receive: (monotonic time, message) pairs."""

    def __init__(self, on_message=None):
        self.dir = tempfile.mkdtemp(prefix="k3d-n-", dir=SCRATCH)
        self.path = os.path.join(self.dir, "notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.1)
        self.got: list[tuple[float, str]] = []
        self.on_message = on_message
        self._stop = False
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        while not self._stop:
            try:
                data = self.sock.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                return
            msg = data.decode()
            if self.on_message:
                self.on_message(msg)
            self.got.append((time.monotonic(), msg))

    def lines(self, prefix):
        return [(t, l) for t, m in self.got for l in m.split("\n") if l.startswith(prefix)]

    def wait_for(self, prefix, timeout=10, after=0.0):
        """The first (arrival time, line) starting with ``prefix`` that arrived after ``after``."""
        hits = poll_for(lambda: [x for x in self.lines(prefix) if x[0] > after], timeout,
                        lambda: f"{prefix}; got {self.got}")
        return hits[0]

    def close(self):
        self._stop = True
        self.t.join(2)
        self.sock.close()


def test_notify_ready_status_watchdog_stopping(checkpoint, start_daemon):
    endpoint = f"ipc://{tempfile.mkdtemp(prefix='k3d-n-', dir=SCRATCH)}/k.sock"
    sock_path = endpoint[len("ipc://"):]
    state_at_ready = {}

    def on_message(msg):
        if "READY=1" in msg.split("\n") and not state_at_ready:
            state_at_ready["ipc"] = os.path.exists(sock_path)
            state_at_ready["arena"] = os.path.exists(sock_path + ".arena")

    n = NotifySocket(on_message)
    try:
        env = dict(os.environ, NOTIFY_SOCKET=n.path, WATCHDOG_USEC="600000")
        d = start_daemon(checkpoint, "--slots", "8", endpoint=endpoint, env=env)
        t_ready, _ = n.wait_for("READY=1")
        assert state_at_ready == {"ipc": True, "arena": True}
        status = [l for _, l in n.lines("STATUS=")]
        assert any("starting: reserving the arena" in l for l in status), status       # before READY
        assert any("hit rate" in l for l in status), status
        with k3client.connect(endpoint, name="n") as c:
            c.fetch(0, [1, 2])

        def pings_since_ready():                 # seven pings: six gaps (~2 s at 0.3 s each)
            pings = [t for t, _ in n.lines("WATCHDOG=1") if t > t_ready]
            return pings if len(pings) >= 7 else None

        pings = poll_for(pings_since_ready, 10, lambda: f"seven watchdog pings after READY: {n.got}")
        gaps = sorted(b - a for a, b in zip(pings, pings[1:]))
        assert len(gaps) >= 2, pings
        median = gaps[len(gaps) // 2]
        assert 0.25 <= median <= 0.45, gaps          # half of WATCHDOG_USEC=0.6 s
        assert not n.lines("STOPPING=1")
        t_term = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(30) == 0
        t_stop, _ = n.wait_for("STOPPING=1", timeout=5)
        assert t_stop >= t_term
    finally:
        n.close()


def test_no_notify_socket_is_a_no_op_and_abstract_socket_works(checkpoint, start_daemon):
    name = f"k3d-test-{os.getpid()}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind("\0" + name)
    s.settimeout(10)
    try:
        d = start_daemon(checkpoint, "--slots", "4", env=dict(os.environ, NOTIFY_SOCKET="@" + name))
        msgs = []
        while not any("READY=1" in m for m in msgs):
            msgs.append(s.recv(4096).decode())
        assert d.stop() == 0
    finally:
        s.close()
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")}
    d = start_daemon(checkpoint, "--slots", "4", env=env)
    assert d.stop() == 0


# -- SIGHUP reload -------------------------------------------------------------------
def wait_log(d, text, timeout=5):
    poll_for(lambda: text in d.log(), timeout, lambda: f"{text!r} in the log:\n{d.log()}", interval=0.02)


def test_sighup_reloads_live_settings(checkpoint, start_daemon, tmp_path):
    trace = tmp_path / "route.trace"
    cfg = tmp_path / "k3d.toml"
    cfg.write_text(f'slots = 16\nlog_level = "info"\nlease_s = 10\npin_quota = 0\ntrace = "{trace}"\n')
    n = NotifySocket()
    try:
        d = start_daemon(checkpoint, "--config", str(cfg), env=dict(os.environ, NOTIFY_SOCKET=n.path))
        n.wait_for("READY=1")
        with k3client.connect(d.endpoint, name="r") as c:
            c.fetch(0, [0, 1, 2])
            c.begin_token()
            # logrotate moves the trace; the new quota, lease and level apply on SIGHUP
            os.rename(trace, tmp_path / "route.trace.1")
            cfg.write_text(f'slots = 32\nlog_level = "debug"\nlease_s = 3\npin_quota = 2\ntrace = "{trace}"\n')
            t_hup = time.monotonic()
            d.proc.send_signal(signal.SIGHUP)
            wait_log(d, "reloaded config")
            log = d.log()
            assert "pin_quota 0 -> 2" in log and "lease_s 10.0 -> 3.0" in log and "log_level 'info' -> 'debug'" in log
            assert "slots only change on restart" in log
            n.wait_for("RELOADING=1", after=t_hup)
            n.wait_for("READY=1", after=t_hup)
            assert any(l.startswith("MONOTONIC_USEC=") for _, m in n.got for l in m.split("\n"))
            with pytest.raises(k3client.QuotaExceeded, match="quota is 2"):
                c.fetch(1, [0, 1, 2])
            c.fetch(1, [0, 1])
            assert trace.exists() and "L1 n=2" in trace.read_text()
            assert "L0 n=3" in (tmp_path / "route.trace.1").read_text()
            assert c.status()["arena"]["slots"] == 16          # not live: unchanged
            assert c.lease_s == 10.0                           # attached before: its lease stays
            with k3client.connect(d.endpoint, name="r2") as c2:
                assert c2.lease_s == 3.0                       # the new lease, for clients attaching now
            # a broken file on reload: logged, the running config stays, serving goes on
            cfg.write_text('pin_quota = 1\nbogus_key = 3\n')
            d.proc.send_signal(signal.SIGHUP)
            wait_log(d, "reload failed, keeping the running config")
            assert "unknown key 'bogus_key'" in d.log()
            c.begin_token()
            c.fetch(2, [0, 1])                                   # quota still 2
        assert d.stop() == 0
    finally:
        n.close()


def test_sighup_keeps_cli_precedence(checkpoint, start_daemon, tmp_path):
    cfg = tmp_path / "k3d.toml"
    cfg.write_text("slots = 8\npin_quota = 5\n")
    d = start_daemon(checkpoint, "--config", str(cfg), "--pin-quota", "1")
    with k3client.connect(d.endpoint, name="p") as c:
        with pytest.raises(k3client.QuotaExceeded):
            c.fetch(0, [0, 1])
        cfg.write_text("slots = 8\npin_quota = 7\n")
        d.proc.send_signal(signal.SIGHUP)
        wait_log(d, "reloaded config")
        with pytest.raises(k3client.QuotaExceeded):          # the command line still wins
            c.fetch(0, [0, 1])
    assert d.stop() == 0


def test_sighup_with_an_unopenable_trace_says_what_it_kept(checkpoint, start_daemon, tmp_path):
    cfg = tmp_path / "k3d.toml"
    cfg.write_text("slots = 8\n")
    d = start_daemon(checkpoint, "--config", str(cfg), "--log-level", "info")
    cfg.write_text('slots = 8\npin_quota = 3\ntrace = "/nonexistent/dir/route.trace"\n')
    d.proc.send_signal(signal.SIGHUP)
    wait_log(d, "reloaded config")
    log = d.log()
    assert "cannot open trace /nonexistent/dir/route.trace" in log
    line = next(l for l in log.splitlines() if "reloaded config" in l)
    assert "pin_quota 0 -> 3" in line and "trace" not in line, line   # the log says what applies
    assert d.stop() == 0
