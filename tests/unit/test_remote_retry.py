"""The one retry loop and the one 206 check every remote transport runs (k3d/sources/remote/retry.py)."""

from __future__ import annotations

import pytest

from k3d.sources import SourceError
from k3d.sources.remote import retry
from k3d.sources.remote.retry import (
    Retryable,
    check_206,
    fill_from,
    retrying,
    skip_bytes,
)


@pytest.fixture
def sleeps(monkeypatch):
    """The backoff sleeps the loop asks for (recorded, not slept: a unit test takes no time)."""
    got = []
    monkeypatch.setattr(retry.time, "sleep", got.append)
    return got


def test_transient_failures_are_retried_with_full_jitter_backoff(sleeps):
    calls = []

    def fn(attempt):
        calls.append(attempt)
        if len(calls) < 3:
            raise Retryable("HTTP 503")
        return "body"

    told = []
    assert retrying(fn, 5, "GET u", lambda n, e: told.append((n, e.reason))) == "body"
    assert calls == [0, 1, 2]
    assert told == [(1, "HTTP 503"), (2, "HTTP 503")]
    assert len(sleeps) == 2
    for n, s in enumerate(sleeps, 1):
        assert 0 <= s <= min(retry.BACKOFF_CAP, retry.BACKOFF_BASE * 2 ** n)


def test_exhausted_retries_name_the_request_and_the_last_reason(sleeps):
    def fn(attempt):
        raise Retryable(f"HTTP 50{attempt}")

    with pytest.raises(SourceError, match=r"^GET http://h/f bytes=0-9 failed after 3 attempts: HTTP 502$"):
        retrying(fn, 2, lambda: "GET http://h/f bytes=0-9")
    assert len(sleeps) == 2


def test_a_stale_keepalive_connection_gets_one_free_retry(sleeps):
    calls = []

    def fn(attempt):
        calls.append(attempt)
        if len(calls) <= 2:
            raise Retryable("RemoteDisconnected", stale=True)
        return len(calls)

    assert retrying(fn, 5, "HEAD u") == 3
    assert calls == [0, 0, 1]          # the first stale one is free: no attempt counted, no sleep
    assert len(sleeps) == 1


def test_a_stale_connection_after_progress_is_an_ordinary_retry(sleeps):
    calls = []

    def fn(attempt):
        calls.append(attempt)
        if len(calls) == 1:
            raise Retryable("reset", progress=10, stale=True)
        return True

    assert retrying(fn, 5, "GET u")
    assert calls == [0, 1] and len(sleeps) == 1


def test_source_errors_are_not_retried(sleeps):
    calls = []

    def fn(attempt):
        calls.append(attempt)
        raise SourceError("origin changed: 412")

    with pytest.raises(SourceError, match="origin changed"):
        retrying(fn, 5, "GET u")
    assert calls == [0] and sleeps == []


def test_skip_bytes_resumes_inside_and_across_buffers():
    a, b = memoryview(bytearray(4)), memoryview(bytearray(6))
    assert [len(x) for x in skip_bytes([a, b], 0)] == [4, 6]
    assert [len(x) for x in skip_bytes([a, b], 3)] == [1, 6]
    assert [len(x) for x in skip_bytes([a, b], 4)] == [6]
    assert [len(x) for x in skip_bytes([a, b], 7)] == [3]
    assert skip_bytes([a, b], 10) == []


def test_fill_from_reports_progress_of_a_short_body():
    body = memoryview(b"abcdefg")
    pos = [0]

    def readinto(buf):
        n = min(len(buf), 3, len(body) - pos[0])
        buf[:n] = body[pos[0]:pos[0] + n]
        pos[0] += n
        return n

    a, b = bytearray(4), bytearray(6)
    with pytest.raises(Retryable, match="truncated body: 7 of 10 bytes") as ei:
        fill_from(readinto, [memoryview(a), memoryview(b)], "GET u")
    assert ei.value.progress == 7 and bytes(a) == b"abcd" and bytes(b[:3]) == b"efg"


def test_fill_from_turns_socket_errors_into_retryable_with_progress():
    def readinto(buf):
        if readinto.n:
            raise ConnectionResetError("peer reset")
        readinto.n = 2
        buf[:2] = b"xy"
        return 2
    readinto.n = 0
    with pytest.raises(Retryable, match="ConnectionResetError after 2 of 5 bytes") as ei:
        fill_from(readinto, [memoryview(bytearray(5))], "GET u")
    assert ei.value.progress == 2


GOOD = {"content_range": "bytes 10-19/100", "content_length": "10", "etag": '"e1"'}


def test_check_206_accepts_the_exact_answer():
    check_206("GET u bytes=10-19", "u", 10, 19, 100, {"etag": '"e1"'}, **GOOD)
    check_206("GET u bytes=10-19", "u", 10, 19, 100, {"etag": '"e1"'},
              **{**GOOD, "content_range": "bytes 10-19/*", "content_length": 10, "etag": None})


@pytest.mark.parametrize("change,match", [
    ({"content_range": "bytes 11-20/100"}, r"^GET u bytes=10-19: Content-Range is 'bytes 11-20/100', not bytes 10-19$"),
    ({"content_range": None}, "Content-Range is None"),
    ({"content_range": "bytes 10-19/101"}, r"^origin changed: u is now 101 bytes, was 100 at start"),
    ({"content_length": "9"}, r"Content-Length '9' is not the 10 bytes asked for"),
    ({"content_length": None}, r"Content-Length None is not the 10 bytes"),
    ({"etag": '"e2"'}, r"^origin changed: u has ETag '\"e2\"', not '\"e1\"' seen at start"),
])
def test_check_206_refuses_any_other_answer(change, match):
    with pytest.raises(SourceError, match=match):
        check_206("GET u bytes=10-19", "u", 10, 19, 100, {"etag": '"e1"'}, **{**GOOD, **change})


def test_check_206_without_an_etag_pins_last_modified():
    v = {"size": 100, "last_modified": "Mon, 01 Jan 2024 00:00:00 GMT"}
    check_206("w", "u", 10, 19, 100, v, **{**GOOD, "etag": None}, last_modified=v["last_modified"])
    with pytest.raises(SourceError, match="origin changed: u is now Last-Modified"):
        check_206("w", "u", 10, 19, 100, v, **{**GOOD, "etag": None}, last_modified="Tue, 02 Jan 2024 00:00:00 GMT")


def test_check_206_uses_the_transports_header_names():
    with pytest.raises(SourceError, match=r"ContentRange is 'bytes 0-1/100'"):
        check_206("w", "u", 10, 19, 100, {"etag": '"e1"'}, **{**GOOD, "content_range": "bytes 0-1/100"},
                  names=("ContentRange", "ContentLength"))
