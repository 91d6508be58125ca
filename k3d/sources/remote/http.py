"""HTTP(S) origins: ``HttpSource``, the transport under ``RemoteSource`` for ``http(s)://`` URLs.

Requests: per host a pool (``_Pool``) of up to ``conns`` persistent
``http.client`` connections (HTTPS verified against the default CA store;
``SSL_CERT_FILE`` points at another).  Every request says ``Accept-Encoding:
identity`` (a compressed body could not be read into slot memory as is) and a
``User-Agent: k3d/VERSION``.

- ``_stat``: HEAD.  Needs Content-Length; ``Accept-Ranges: none`` is refused.
  A strong ETag is pinned; a weak one (``W/``) cannot guard byte ranges, so
  then size + Last-Modified are (a warning says so).
- ``_get_small``: GET of a whole small file (the index); 404 -> None.
- ``_get_into``: GET with ``Range: bytes=a-b`` (one range, never multipart) and
  ``If-Match: <pinned ETag>`` (or ``If-Unmodified-Since`` with only
  Last-Modified), so a changed file is a 412: "origin changed", never a mix of
  two versions.  The answer must be 206 and pass ``retry.check_206``; its body
  is read with ``readinto`` into slot memory within ``timeout`` seconds for
  the whole request (``fill_from``'s deadline).  A 200 (Range ignored) is an
  error, not a whole-file download.  5xx, 408, 429, transport errors and
  timeouts are ``Retryable``; a reused connection the server had closed is
  marked stale (one free retry in ``retry.retrying``).

HEAD and small GETs run through ``retry.retrying`` here; ranged GETs through
``RemoteSource.fetch_into``, which resumes after the bytes that landed.

Thread-safety: ``_get_into`` runs on many reader threads.  A pool's idle list
is guarded by its lock and its size by a semaphore (``get`` blocks while all
connections are busy; every path returns the permit, also on errors); the
pools table by ``_pools_mu``.  A connection is used by one thread at a time
and goes back to the pool only after its whole body was read.
"""

from __future__ import annotations

import http.client
import logging
import socket
import ssl
import threading
import time
import urllib.parse

from k3d import __version__

from ..base import SourceError
from .retry import RETRY_STATUS, Retryable, check_206, fill_from, retrying
from .source import RemoteSource

log = logging.getLogger("k3d")


class _Pool:
    """Up to ``size`` persistent connections to one host; ``get`` blocks while all are busy."""

    def __init__(self, scheme: str, netloc: str, size: int, timeout: float):
        self.scheme, self.netloc, self.timeout = scheme, netloc, timeout
        self._sem = threading.BoundedSemaphore(size)
        self._idle: list[http.client.HTTPConnection] = []
        self._mu = threading.Lock()
        self._ctx = ssl.create_default_context() if scheme == "https" else None

    def get(self) -> tuple[http.client.HTTPConnection, bool]:
        self._sem.acquire()
        with self._mu:
            if self._idle:
                return self._idle.pop(), True
        if self.scheme == "https":
            return http.client.HTTPSConnection(self.netloc, timeout=self.timeout, context=self._ctx), False
        return http.client.HTTPConnection(self.netloc, timeout=self.timeout), False

    def put(self, conn, reusable: bool) -> None:
        if reusable:
            with self._mu:
                self._idle.append(conn)
        else:
            conn.close()
        self._sem.release()

    def close(self) -> None:
        with self._mu:
            for c in self._idle:
                c.close()
            self._idle = []


class HttpSource(RemoteSource):
    kind = "http"

    def __init__(self, url: str, pattern: str, *, conns: int = 4, timeout: float = 30.0, **kw):
        self._pools: dict[tuple[str, str], _Pool] = {}
        self._conns, self._timeout = conns, timeout
        self._pools_mu = threading.Lock()
        self._ua = f"k3d/{__version__}"
        super().__init__(url, pattern, **kw)

    def _pool(self, url: str) -> tuple[_Pool, str]:
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https"):
            raise SourceError(f"{url}: not an http(s) URL")
        with self._pools_mu:
            pool = self._pools.get((u.scheme, u.netloc))
            if pool is None:
                pool = self._pools[(u.scheme, u.netloc)] = _Pool(u.scheme, u.netloc, self._conns, self._timeout)
        # non-ASCII and spaces in the path quoted; what is already %-encoded stays as given
        path = urllib.parse.quote(u.path or "/", safe="/%:@!$&'()*+,;=~-._")
        return pool, path + (f"?{u.query}" if u.query else "")

    def _request(self, method: str, url: str, headers: dict):
        """Send one request; returns (pool, conn, response). Transport failures are Retryable."""
        pool, target = self._pool(url)
        conn, reused = pool.get()
        try:
            conn.request(method, target, headers={"User-Agent": self._ua, "Accept-Encoding": "identity", **headers})
            resp = conn.getresponse()
        except ssl.SSLCertVerificationError as e:
            pool.put(conn, False)
            raise SourceError(f"{method} {url}: TLS certificate not trusted ({e.verify_message}); "
                              "point SSL_CERT_FILE at its CA bundle") from None
        except (http.client.InvalidURL, UnicodeError, ValueError) as e:   # no retry mends the URL
            pool.put(conn, False)
            raise SourceError(f"{method} {url!r}: not a usable URL ({e})") from None
        except (OSError, http.client.HTTPException) as e:
            pool.put(conn, False)
            stale = reused and isinstance(e, (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError))
            kind = "timed out" if isinstance(e, (socket.timeout, TimeoutError)) else type(e).__name__
            raise Retryable(f"{method} {url}: {kind}: {e}", 0, stale) from None
        except BaseException:
            pool.put(conn, False)        # never keep the pool's permit
            raise
        return pool, conn, resp

    def _simple(self, method: str, url: str, ok_missing: bool):
        """HEAD or small GET with the retry loop; returns the response and its body (None: 404)."""
        def attempt(_n: int):
            pool, conn, resp = self._request(method, url, {})
            try:
                body = resp.read()
            except (OSError, http.client.HTTPException) as e:
                pool.put(conn, False)
                raise Retryable(f"{method} {url}: {type(e).__name__}: {e}") from None
            if resp.status in RETRY_STATUS:
                pool.put(conn, False)
                raise Retryable(f"{method} {url}: HTTP {resp.status} {resp.reason}")
            pool.put(conn, not resp.will_close)
            if resp.status == 404 and ok_missing:
                return resp, None
            if resp.status != 200:
                raise SourceError(f"{method} {url}: HTTP {resp.status} {resp.reason}"
                                  + (" (not found)" if resp.status == 404 else ""))
            return resp, body
        return retrying(attempt, self.retries, f"{method} {url}")

    def _stat(self, url: str) -> tuple[int, dict]:
        resp, _ = self._simple("HEAD", url, ok_missing=False)
        length = resp.getheader("Content-Length")
        if length is None or not length.isdigit():
            raise SourceError(f"HEAD {url}: no Content-Length; cannot serve ranges of it")
        if resp.getheader("Accept-Ranges", "bytes").strip().lower() == "none":
            raise SourceError(f"{url}: the server says Accept-Ranges: none")
        etag, lm = resp.getheader("ETag"), resp.getheader("Last-Modified")
        if etag and etag.startswith("W/"):
            etag = None      # a weak ETag cannot guard byte ranges (If-Match needs a strong one)
        v = {"etag": etag} if etag else {"size": int(length), "last_modified": lm}
        if not etag:
            log.warning("%s has no strong ETag: consistency is checked by %s", url,
                        "Last-Modified and size" if lm else "size only")
        return int(length), v

    def _get_small(self, url: str) -> bytes | None:
        return self._simple("GET", url, ok_missing=True)[1]

    def _get_into(self, fi: int, start: int, bufs: list[memoryview], attempt: int) -> None:
        url, v = self.files[fi], self.validators[fi]
        want = sum(len(b) for b in bufs)
        end = start + want - 1
        headers = {"Range": f"bytes={start}-{end}"}
        if v.get("etag"):
            headers["If-Match"] = v["etag"]
        elif v.get("last_modified"):
            headers["If-Unmodified-Since"] = v["last_modified"]
        deadline = time.monotonic() + self._timeout      # --http-timeout: the whole request
        pool, conn, resp = self._request("GET", url, headers)
        reusable = False
        try:
            st = resp.status
            where = f"GET {url} bytes={start}-{end}"
            if st == 206:
                check_206(where, url, start, end, self.sizes[fi], v, content_range=resp.getheader("Content-Range"),
                          content_length=resp.getheader("Content-Length"), etag=resp.getheader("ETag"),
                          last_modified=resp.getheader("Last-Modified"),
                          names=("the response's Content-Range", "Content-Length"))
                fill_from(resp.readinto, bufs, where, deadline)
                reusable = not resp.will_close
                return
            if st == 200:
                raise SourceError(f"{where}: the server ignored the Range header (200 OK, "
                                  f"{resp.getheader('Content-Length', '?')} bytes); refusing a whole-file download")
            if st == 412:
                raise SourceError(f"origin changed: {url} no longer matches "
                                  f"{'ETag ' + repr(v['etag']) if v.get('etag') else 'its Last-Modified'} "
                                  "seen at start "
                                  "(412 Precondition Failed); restart k3d to serve the new version")
            if st in RETRY_STATUS:
                raise Retryable(f"HTTP {st} {resp.reason}")
            raise SourceError(f"{where}: HTTP {st} {resp.reason}")
        finally:
            pool.put(conn, reusable)

    def close(self):
        super().close()
        for p in self._pools.values():
            p.close()

