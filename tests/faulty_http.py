"""Real HTTP servers for the remote-source tests and benchmarks.

``FaultyServer``: a ThreadingHTTPServer (HTTP/1.1, keep-alive) serving a
directory with HEAD, single-range GET, a strong ETag per file and If-Match
(412 on a mismatch), that injects faults on demand.  A fault applies to the
next ``times`` matching ranged GETs (``times=None``: all of them)::

    ignore_range   200 with the whole file (the client must refuse it)
    truncate       206 headers for the full range, half the body, then close
    reset          close the socket with SO_LINGER 0 (a TCP RST) before answering
    stall          sleep ``stall_s`` before answering (the client must time out)
    status         answer ``status`` (500, 503, 404 ...) with an empty body
    bad_range      206 whose Content-Range is off by one byte
    short_length   206 whose Content-Length is one byte short of the range
    trickle        206 whose body comes 4 KiB every ``stall_s`` seconds (never stalls a read)

``set_etag(name, etag)`` changes a file's ETag mid-run (as a re-upload would);
``validators = False`` sends neither ETag nor Last-Modified (a bare server).
Paths are percent-decoded, as real servers do.
Every request is logged in ``requests`` (method, path, Range, If-Match, client port).

``Nginx``: starts the system nginx (Debian) on a loopback port with a generated
config, daemon off, pid/logs/temp files under a private directory; used as
the real origin.  ``nginx_binary()`` finds it (installing it with apt-get when
running as root and it is missing).

Thread-safety: the fault list and request log are guarded by one lock; each
connection is served by its own thread.
"""

from __future__ import annotations

import os
import shutil
import socket
import struct
import subprocess
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from helpers import poll_for


@dataclass
class Fault:
    kind: str
    times: int | None = 1
    path: str | None = None        # substring of the request path; None: any file
    status: int = 503
    stall_s: float = 5.0


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "faulty/1"

    def log_message(self, *args):    # quiet: the tests read ``requests`` instead
        pass

    def _file(self):
        rel = urllib.parse.unquote(self.path.split("?", 1)[0]).lstrip("/")
        full = os.path.realpath(os.path.join(self.server.root, rel))
        if not full.startswith(self.server.root + os.sep) or not os.path.isfile(full):
            return rel, None
        return rel, full

    def _headers_common(self, rel, size):
        if self.server.validators:
            self.send_header("ETag", self.server.etag(rel, size))
            self.send_header("Last-Modified", "Tue, 01 Dec 2026 00:00:00 GMT")
        self.send_header("Accept-Ranges", "bytes")

    def do_HEAD(self):
        rel, full = self._file()
        self.server.log(("HEAD", rel, None, None, self.client_address[1]))
        if full is None:
            return self._empty(404)
        size = os.path.getsize(full)
        self.send_response(200)
        self._headers_common(rel, size)
        self.send_header("Content-Length", str(size))
        self.end_headers()

    def _empty(self, code):
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self):
        rel, full = self._file()
        rng, im = self.headers.get("Range"), self.headers.get("If-Match")
        self.server.log(("GET", rel, rng, im, self.client_address[1]))
        if full is None:
            return self._empty(404)
        size = os.path.getsize(full)
        etag = self.server.etag(rel, size)
        if im is not None and im != "*" and im != etag:
            return self._empty(412)
        fault = self.server.take(rel) if rng else None
        kind = fault.kind if fault else None
        if kind == "reset":
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True
            return
        if kind == "stall":
            time.sleep(fault.stall_s)
        if kind == "status":
            self.send_response(fault.status)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        start, end = 0, size - 1
        partial = False
        if rng and kind != "ignore_range":
            spec = rng.strip()
            if not spec.startswith("bytes=") or "," in spec:
                return self._empty(416)
            a, _, b = spec[6:].partition("-")
            start, end = int(a), min(int(b) if b else size - 1, size - 1)
            if start > end:
                return self._empty(416)
            partial = True
        length = end - start + 1
        self.send_response(206 if partial else 200)
        self._headers_common(rel, size)
        if partial:
            shift = 1 if kind == "bad_range" else 0
            self.send_header("Content-Range", f"bytes {start + shift}-{end + shift}/{size}")
        self.send_header("Content-Length", str(length - (1 if kind == "short_length" else 0)))
        self.end_headers()
        send = length // 2 if kind == "truncate" else length - (1 if kind == "short_length" else 0)
        with open(full, "rb") as f:
            f.seek(start)
            left = send
            while left:
                chunk = f.read(min(left, 4096 if kind == "trickle" else 1 << 20))
                if not chunk:
                    break
                self.wfile.write(chunk)
                left -= len(chunk)
                if kind == "trickle":
                    self.wfile.flush()
                    time.sleep(fault.stall_s)
        self.wfile.flush()
        if kind == "truncate":
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True


class FaultyServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, root: str, port: int = 0):
        super().__init__(("127.0.0.1", port), _Handler)
        self.root = os.path.realpath(root)
        self._mu = threading.Lock()
        self.faults: list[Fault] = []
        self.etags: dict[str, str] = {}
        self.validators = True
        self.requests: list[tuple] = []
        self._thread = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/"

    def handle_error(self, request, client_address):   # resets and closed sockets are the point
        pass

    def etag(self, rel: str, size: int) -> str:
        with self._mu:
            return self.etags.get(rel, f'"v1-{size:x}"')

    def set_etag(self, rel: str, etag: str) -> None:
        with self._mu:
            self.etags[rel] = etag

    def add(self, *faults: Fault) -> None:
        with self._mu:
            self.faults.extend(faults)

    def clear(self) -> None:
        with self._mu:
            self.faults = []
            self.requests = []

    def take(self, rel: str) -> Fault | None:
        with self._mu:
            for f in self.faults:
                if f.path is None or f.path in rel:
                    if f.times is not None:
                        f.times -= 1
                        if f.times <= 0:
                            self.faults.remove(f)
                    return f
        return None

    def log(self, entry) -> None:
        with self._mu:
            self.requests.append(entry)

    def start(self) -> "FaultyServer":
        self._thread = threading.Thread(target=self.serve_forever, name="faulty-http", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


# -- nginx -------------------------------------------------------------------------------------
def nginx_binary(install: bool = True) -> str | None:
    """The nginx executable; installs Debian's nginx(-light) with apt-get when root and missing."""
    for cand in (shutil.which("nginx"), "/usr/sbin/nginx"):
        if cand and os.access(cand, os.X_OK):
            return cand
    if install and os.geteuid() == 0 and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        # nginx-light is Debian 12's small build; later releases ship only ``nginx``
        for pkg in ("nginx-light", "nginx"):
            try:
                subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", pkg],
                               env=env, capture_output=True, timeout=300)
            except (OSError, subprocess.TimeoutExpired):
                return None
            found = nginx_binary(install=False)
            if found:
                return found
        return None
    return None


def self_signed(directory: str) -> tuple[str, str]:
    """A throwaway certificate for 127.0.0.1 (openssl CLI); returns (cert.pem, key.pem)."""
    cert, key = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Nginx:
    """``with Nginx(root) as n: n.url`` -- nginx serving ``root`` on 127.0.0.1."""

    def __init__(self, root: str, binary: str | None = None, workers: int = 2, tls: tuple | None = None):
        self.root = os.path.realpath(root)
        self.tls = tls                      # (cert.pem, key.pem): serve https
        self.binary = binary or nginx_binary()
        if self.binary is None:
            raise RuntimeError("nginx is not installed (apt-get install -y nginx-light)")
        self.dir = tempfile.mkdtemp(prefix="k3d-nginx-")
        self.port = free_port()
        self.workers = workers
        self.proc = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}/"

    def config(self) -> str:
        d = self.dir
        user = "user root;\n" if os.geteuid() == 0 else ""   # workers must read root-owned tmp dirs
        listen = f"127.0.0.1:{self.port}"
        if self.tls:
            listen += f" ssl;\n        ssl_certificate {self.tls[0]};\n        ssl_certificate_key {self.tls[1]}"
        return f"""{user}daemon off;
worker_processes {self.workers};
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {d}/body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    default_type application/octet-stream;
    sendfile on;
    tcp_nopush on;
    keepalive_timeout 75s;
    keepalive_requests 100000;
    server {{
        listen {listen};
        root {self.root};
        location / {{ }}
    }}
}}
"""

    def start(self) -> "Nginx":
        conf = os.path.join(self.dir, "nginx.conf")
        with open(conf, "w") as f:
            f.write(self.config())
        self.proc = subprocess.Popen([self.binary, "-p", self.dir, "-c", conf, "-e", f"{self.dir}/error.log"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            poll_for(self._listening, 15, interval=0.05)
        except AssertionError:
            self.stop()
            raise RuntimeError(f"nginx did not listen on {self.port}: {self._errlog()}") from None
        return self

    def _listening(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"nginx exited {self.proc.returncode}: {self.proc.stderr.read().decode()}"
                               f"{self._errlog()}")
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return True
        except OSError:
            return False

    def _errlog(self) -> str:
        try:
            with open(os.path.join(self.dir, "error.log")) as f:
                return f.read()
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
