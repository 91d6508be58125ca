"""S3-compatible object stores: ``s3://bucket/prefix/`` through boto3 (the optional ``s3`` extra).

The checkpoint forms, header images (headers.py), response checks and the
retry loop (retry.py), disk tier (tiers.py) and counters are shared with HTTP
through ``RemoteSource`` (source.py); this module is the transport:

- ``_stat``: HeadObject -> ContentLength and the ETag, which is pinned.
- ``_get_small``: GetObject of the whole index.json (NoSuchKey -> None).
- ``_get_into``: GetObject with ``Range=bytes=a-b`` and ``IfMatch=<pinned ETag>``;
  the answer must be 206 and pass ``retry.check_206`` (``ContentRange`` exactly as
  asked, ``ContentLength`` = b - a + 1, the same ETag); the body (urllib3's stream) is read with
  ``readinto`` straight into slot memory.  PreconditionFailed (412) means the
  object was replaced: an error naming it.  5xx, SlowDown/throttling, timeouts
  and dropped connections are ``Retryable``.  ``retry.retrying`` is the only
  retry loop (HeadObject and the index GET here, ranged reads in
  ``RemoteSource.fetch_into``): botocore's own retries are off, so the counters
  see each one.  A body cut short (a short read, a socket error in
  ``readinto``) resumes after the bytes that landed, as over HTTP; any other
  failure inside botocore's stream is retried from the start of the range.

Endpoint, region and credentials come from boto3's usual chain (AWS_ENDPOINT_URL,
AWS_REGION / AWS_DEFAULT_REGION, AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY,
AWS_PROFILE, ~/.aws/config, instance roles); k3d reads none of them itself.

boto3 is the optional ``s3`` extra: imported when an S3Source is built, so
k3d without it serves every other source.

Thread: built on the main thread; one boto3 client (clients are thread-safe) whose urllib3 pool
holds ``conns`` persistent connections; ``read`` runs in many reader threads.
"""

from __future__ import annotations

from ..base import SourceError
from .retry import RETRY_STATUS, Retryable, check_206, fill_from, retrying
from .source import RemoteSource

_RETRY_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
                "InternalError", "ServiceUnavailable", "503", "500"}


def split_url(url: str) -> tuple[str, str]:
    if not url.startswith("s3://"):
        raise SourceError(f"{url}: not an s3:// URL")
    bucket, _, key = url[5:].partition("/")
    if not bucket:
        raise SourceError(f"{url}: no bucket (use s3://bucket/prefix/)")
    return bucket, key


class S3Source(RemoteSource):
    kind = "s3"

    def __init__(self, url: str, pattern: str, *, conns: int = 4, timeout: float = 30.0, **kw):
        try:      # lazily: boto3 is the optional s3 extra (see the module docstring)
            import boto3
            import botocore.config
            import botocore.exceptions
        except ImportError:
            raise SourceError(f"{url}: S3 sources need boto3: pip install 'k3d-expert-cache[s3]'") from None
        self._exc = botocore.exceptions
        split_url(url)
        cfg = botocore.config.Config(max_pool_connections=conns, connect_timeout=timeout, read_timeout=timeout,
                                     retries={"total_max_attempts": 1})
        try:
            self._s3 = boto3.session.Session().client("s3", config=cfg)
        except self._exc.BotoCoreError as e:
            raise SourceError(f"{url}: cannot make an S3 client: {e}") from None
        super().__init__(url, pattern, **kw)

    def join(self, base: str, name: str) -> str:
        return (base if base.endswith("/") else base.rsplit("/", 1)[0] + "/") + name

    def _classify(self, url: str, op: str, e: Exception):
        """A botocore failure -> Retryable or SourceError."""
        if isinstance(e, self._exc.ClientError):
            err = e.response.get("Error", {})
            code = str(err.get("Code", "?"))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if status == 412 or code == "PreconditionFailed":
                return SourceError(f"origin changed: {url} no longer matches the ETag seen at start "
                                   "(412 PreconditionFailed); restart k3d to serve the new version")
            if status in RETRY_STATUS or code in _RETRY_CODES:
                return Retryable(f"{op} {url}: HTTP {status} {code}")
            return SourceError(f"{op} {url}: HTTP {status} {code}: {err.get('Message', '')}".rstrip(": "))
        if isinstance(e, (self._exc.EndpointConnectionError, self._exc.ConnectionClosedError,
                          self._exc.ReadTimeoutError, self._exc.ConnectTimeoutError,
                          self._exc.ResponseStreamingError, self._exc.IncompleteReadError, OSError)):
            return Retryable(f"{op} {url}: {type(e).__name__}: {e}")
        if isinstance(e, self._exc.NoCredentialsError):
            return SourceError(f"{op} {url}: no AWS credentials (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY "
                               "or AWS_PROFILE)")
        return SourceError(f"{op} {url}: {type(e).__name__}: {e}")

    def _retrying(self, url: str, op: str, fn):
        """``fn()`` through ``retry.retrying``, botocore failures classified."""
        def attempt(_n: int):
            try:
                return fn()
            except SourceError:
                raise           # already one line (a 404 from head()): not wrapped in another
            except Exception as e:  # noqa: BLE001 - botocore raises many types; _classify sorts them
                raise self._classify(url, op, e) from None
        return retrying(attempt, self.retries, f"{op} {url}")

    def _stat(self, url: str) -> tuple[int, dict]:
        bucket, key = split_url(url)

        def head():
            try:
                return self._s3.head_object(Bucket=bucket, Key=key)
            except self._exc.ClientError as e:
                if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                    raise SourceError(f"HeadObject {url}: HTTP 404 (not found)") from None
                raise
        h = self._retrying(url, "HeadObject", head)
        etag = h.get("ETag")
        if not etag:
            raise SourceError(f"HeadObject {url}: no ETag; cannot pin the object's version")
        return int(h["ContentLength"]), {"etag": etag}

    def _get_small(self, url: str) -> bytes | None:
        bucket, key = split_url(url)

        def get():
            try:
                r = self._s3.get_object(Bucket=bucket, Key=key)
            except self._exc.ClientError as e:
                if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                    return None
                raise
            with r["Body"] as body:
                return body.read()
        return self._retrying(url, "GetObject", get)

    def _get_into(self, fi: int, start: int, bufs: list[memoryview], attempt: int) -> None:
        url, etag = self.files[fi], self.validators[fi]["etag"]
        bucket, key = split_url(url)
        want = sum(len(b) for b in bufs)
        end = start + want - 1
        where = f"GetObject {url} bytes={start}-{end}"
        try:
            r = self._s3.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end}", IfMatch=etag)
        except Exception as e:  # noqa: BLE001 - botocore raises many types; _classify sorts them
            err = self._classify(url, "GetObject", e)
            raise err from None
        body = r["Body"]
        try:
            status = r.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status == 200:
                raise SourceError(f"{where}: the store ignored the Range (200 OK, {r.get('ContentLength')} bytes); "
                                  "refusing a whole-object download")
            if status != 206:
                raise SourceError(f"{where}: HTTP {status}, expected 206 Partial Content")
            check_206(where, url, start, end, self.sizes[fi], {"etag": etag}, content_range=r.get("ContentRange"),
                      content_length=r.get("ContentLength"), etag=r.get("ETag"),
                      names=("ContentRange", "ContentLength"))
            raw = getattr(body, "_raw_stream", None)
            if raw is not None and hasattr(raw, "readinto"):
                fill_from(raw.readinto, bufs, where)
            else:    # no readinto on this botocore: a bounded copy per chunk
                def readinto(b):
                    chunk = body.read(min(len(b), 1 << 20))
                    b[:len(chunk)] = chunk
                    return len(chunk)
                fill_from(readinto, bufs, where)
        except Retryable:
            raise
        except SourceError:
            raise
        except Exception as e:  # noqa: BLE001 - urllib3 protocol errors mid-body: not resumed here, refetched
            raise Retryable(f"{where}: {type(e).__name__}: {e}") from None
        finally:
            body.close()
