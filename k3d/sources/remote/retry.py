"""One request to a remote origin: the retry loop, the 206 check, the body fill.

Every transport (``http.py``, ``s3.py``) runs each request through these, so
the rules below hold for HTTP(S) and S3 alike:

- ``retrying(fn, retries, what)`` is the only retry loop.  ``fn(attempt)`` makes
  one request; it raises ``Retryable`` for a transient failure (5xx, 408, 429,
  throttling, connection resets/refusals, timeouts, truncated bodies) and
  ``SourceError`` for one no retry can mend.  After a ``Retryable`` the loop
  sleeps full-jitter exponential backoff (uniform(0, min(BACKOFF_CAP,
  BACKOFF_BASE * 2**n))) and calls ``fn`` again, up to ``retries`` times; a
  stale pooled keep-alive connection (``stale``, nothing received) gets one
  free retry on a fresh connection, no wait.  Exhausted retries become an
  ``OriginDown`` (a ``SourceError``): "WHAT failed after N attempts: last reason".  Resuming is
  the caller's: a ``Retryable`` carries ``progress``, the body bytes that had
  already landed (checked against Content-Range and the validator), and the
  caller asks for the rest with ``skip_bytes``.
- ``check_206`` is the only response check of a ranged read: Content-Range
  exactly ``bytes a-b/size`` as asked (size = the size pinned at start),
  Content-Length = b - a + 1, and the ETag (or, without one, Last-Modified)
  the pinned one.  Any failure is a ``SourceError`` (the expert's load fails;
  its bytes are never served); a changed size or validator says "origin changed".
- ``fill_from`` reads a body with ``readinto`` straight into slot memory; a
  short or trickling body is ``Retryable`` with its progress.

Thread-safety: pure functions (``retrying`` calls ``fn`` and ``on_retry`` in the
caller's thread, a reader thread or the main thread while a source opens).
"""

from __future__ import annotations

import http.client
import random
import re
import time
from collections.abc import Callable
from typing import TypeVar

from ..base import SourceError

BACKOFF_BASE, BACKOFF_CAP = 0.05, 2.0
RETRY_STATUS = {408, 429, 500, 502, 503, 504}
_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)\Z")

T = TypeVar("T")


class OriginDown(SourceError):
    """A request still failing after its retries (refused, reset, timed out, 5xx): the origin
    does not answer now.  Raised by ``retrying`` alone."""


class Retryable(Exception):
    """A transient failure of one request; ``progress`` bytes of the body had landed."""

    def __init__(self, reason: str, progress: int = 0, stale: bool = False):
        super().__init__(reason)
        self.reason, self.progress, self.stale = reason, progress, stale


def backoff(attempt: int) -> float:
    """Seconds to sleep before retry ``attempt`` (1-based): full jitter."""
    return random.uniform(0, min(BACKOFF_CAP, BACKOFF_BASE * 2 ** attempt))


def retrying(fn: Callable[[int], T], retries: int, what: str | Callable[[], str],
             on_retry: Callable[[int, Retryable], None] | None = None) -> T:
    """``fn(attempt)`` until it returns; see the module docstring.  ``what`` (or what it
    returns, read only on failure) names the request in the final error; ``on_retry(n, e)``
    is told of retry ``n`` before its backoff (counters, log lines)."""
    attempt, free = 0, True
    while True:
        try:
            return fn(attempt)
        except Retryable as e:
            if e.stale and free and not e.progress:
                free = False       # a keep-alive connection the server had closed: once, no wait
                continue
            attempt += 1
            if attempt > retries:
                name = what() if callable(what) else what
                raise OriginDown(f"{name} failed after {attempt} attempts: {e.reason}") from None
            if on_retry is not None:
                on_retry(attempt, e)
            time.sleep(backoff(attempt))


def skip_bytes(bufs: list[memoryview], n: int) -> list[memoryview]:
    """``bufs`` without their first ``n`` bytes (slices, no copies)."""
    out = []
    for b in bufs:
        if n >= len(b):
            n -= len(b)
            continue
        out.append(b[n:] if n else b)
        n = 0
    return out


def fill_from(readinto, bufs: list[memoryview], what: str, deadline: float | None = None) -> int:
    """Read a body into ``bufs`` with ``readinto``; a short body is Retryable, and so is
    one still arriving at ``deadline`` (monotonic): the socket timeout bounds each read,
    not a body that trickles in."""
    got = pos = 0
    want = sum(len(b) for b in bufs)
    try:
        for b in bufs:
            pos = 0
            while pos < len(b):
                if deadline is not None and time.monotonic() > deadline:
                    raise Retryable(f"timed out: {got + pos} of {want} bytes of {what} arrived "
                                    "within the request timeout", got + pos)
                n = readinto(b[pos:])
                if not n:
                    raise Retryable(f"truncated body: {got + pos} of {want} bytes of {what}", got + pos)
                pos += n
            got += len(b)
            pos = 0
    except (OSError, http.client.HTTPException) as e:
        # partial bytes already in bufs are good (the range was checked): resume after them
        part = got + pos
        raise Retryable(f"{type(e).__name__} after {part} of {want} bytes of {what}: {e}", part) from None
    return got


def _count(v) -> int | None:
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().isdigit():
        return int(v)
    return None


def check_206(where: str, url: str, start: int, end: int, size: int, validator: dict, *,
              content_range, content_length, etag, last_modified=None,
              names: tuple[str, str] = ("Content-Range", "Content-Length")) -> None:
    """Check a 206 answer to ``bytes=start-end`` of ``url`` (``size`` and ``validator``
    pinned at start); ``names`` are the transport's words for the two headers."""
    cr = (content_range or "").strip()
    m = _CONTENT_RANGE.match(cr)
    if not m or int(m[1]) != start or int(m[2]) != end:
        raise SourceError(f"{where}: {names[0]} is {content_range!r}, not bytes {start}-{end}")
    if m[3] != "*" and int(m[3]) != size:
        raise SourceError(f"origin changed: {url} is now {m[3]} bytes, was {size} "
                          "at start; restart k3d to serve the new version")
    if _count(content_length) != end - start + 1:
        raise SourceError(f"{where}: {names[1]} {content_length!r} is not the {end - start + 1} bytes asked for")
    pinned = validator.get("etag")
    if pinned and etag and etag != pinned:
        raise SourceError(f"origin changed: {url} has ETag {etag!r}, not {pinned!r} seen at start; "
                          "restart k3d to serve the new version")
    lm = validator.get("last_modified")
    if not pinned and lm and last_modified and last_modified != lm:
        raise SourceError(f"origin changed: {url} is now Last-Modified {last_modified!r}, "
                          f"was {lm!r}; restart k3d to serve the new version")
