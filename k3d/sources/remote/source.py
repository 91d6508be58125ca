"""``RemoteSource``: a checkpoint on an origin (HTTP(S), S3) as the ``Source`` readers use.

A transport subclass (``HttpSource`` in http.py, ``S3Source`` in s3.py)
supplies three primitives:

- ``_stat(url)``: size and validator (the ETag, else size + Last-Modified),
  pinned at start for the whole run;
- ``_get_small(url)``: a whole small file (the index.json), None when missing;
- ``_get_into(fi, start, bufs, attempt)``: one ranged request whose body is
  read with ``readinto`` straight into ``bufs`` (slot memory), checked with
  ``retry.check_206``; transient failures raise ``retry.Retryable``.

This class adds what every transport shares:

- opening (``headers.open_catalog``): files stat'ed, headers fetched into
  sparse images and parsed by the local parsers: format, layout, extents.
  With a disk tier the origin's answers are recorded and kept there
  (kept.py); when the origin does not answer at start (``OriginDown``) the
  same parsers run on the kept answers instead;
- ``fetch_into``: a run of bytes with the one retry loop (``retry.retrying``),
  resuming after the bytes that had landed; counts requests, retries, errors,
  and tells ``OriginState`` (origin.py) whether the origin answered: while
  it is down, each request gets one attempt;
- ``read``: finds the expert a part belongs to (by file offset) and hands the
  part to ``tiers.Tiers`` (disk entry or origin, crc, write-behind).

Reads: a part (``split_extents`` output) is coalesced into runs of
file-contiguous extents; each run is one single-range request (never
multipart) whose body lands in the run's slot slices.  ``max_parts = 1``: an
expert is one part, so one request when its tensors are adjacent (safetensors
writers sort by dtype then name, so usually they are).

Refused at start: a file whose server sends neither a strong ETag nor
Last-Modified (a changed file could not be told from the one k3d started
with; a retry could resume into the new version), unless it is a .k3pack,
whose crc32 per expert catches that.

Thread: built on the main thread (all header I/O happens there); afterwards
the catalog (files, sizes, validators, layout, keys, expected_crc) is
read-only, ``read`` runs on many reader threads, and ``close`` runs on the
main thread after the readers stopped.  Shared mutable state: the
transport's connection pool, ``Counters`` and the tiers' tables (each with
its own lock; see tiers.py).
"""

from __future__ import annotations

import abc
import bisect
import logging
import urllib.parse

from ..base import Extent, Source, SourceError
from .disk_cache import DiskCache, DiskCacheError
from .headers import open_catalog
from .kept import Recorder, Replay
from .origin import OriginState
from .retry import OriginDown, Retryable, retrying, skip_bytes
from .tiers import Counters, Tiers

log = logging.getLogger("k3d")


class RemoteSource(Source, metaclass=abc.ABCMeta):
    kind = "remote"
    max_parts = 1     # one coalesced single-range request per expert

    def __init__(self, url: str, pattern: str, *, disk_cache: str | None = None,
                 disk_cache_size: int = 0, retries: int = 5):
        super().__init__()
        self.path = url
        self.retries = retries
        self.validators: list[dict] = []
        self.sizes: list[int] = []
        self.counters = Counters()
        self.tiers: Tiers | None = None
        self.origin = OriginState(url)
        self._recorder: Recorder | None = None
        self._replay: Replay | None = None
        cat = self._open(url, pattern, disk_cache)
        self.format, self.layout, self.keys = cat.format, cat.layout, cat.keys
        self.tensor_format, self.tensor_types, self.expected_crc = cat.tensor_format, cat.tensor_types, cat.expected_crc
        self.layouts, self.layer_tensor_types, self.family = cat.layouts, cat.layer_tensor_types, cat.family
        self.family_fields = cat.family_fields
        if not self.keys:
            raise SourceError(f"{url}: no experts")
        blind = [f for f, v in zip(self.files, self.validators) if not v.get("etag") and not v.get("last_modified")]
        if blind and self.format != "packed":
            # Without a validator a file changed mid-run (or between runs, for the disk tier)
            # cannot be told from the one k3d started with: a retry could resume into the new
            # version.  A .k3pack carries a crc32 per expert, so it is safe anyway.
            raise SourceError(f"{blind[0]}: the server sends neither a strong ETag nor Last-Modified, so k3d "
                              "could not tell a changed file from the one it started with; serve it from a server "
                              "that does (nginx, S3), or `k3d pack` it and serve the .k3pack (crc32 per expert)")
        self._owners = self._build_owners()
        cache = None
        if disk_cache:
            try:
                cache = DiskCache(disk_cache, disk_cache_size)
            except DiskCacheError as e:
                raise SourceError(str(e)) from None
            self._keep_headers(disk_cache)
        self.tiers = Tiers(url, cat, self.files, self.validators, cache, self.fetch_into, self.counters)

    # -- transport primitives (subclasses) --------------------------------------------------
    @abc.abstractmethod
    def _stat(self, url: str) -> tuple[int, dict]:
        """(size, validators) of one origin file."""

    @abc.abstractmethod
    def _get_small(self, url: str) -> bytes | None:
        """A whole small file (the index), or None if it does not exist."""

    @abc.abstractmethod
    def _get_into(self, fi: int, start: int, bufs: list[memoryview], attempt: int) -> None:
        """One ranged read of file ``fi`` from ``start`` into ``bufs``, checked."""

    def join(self, base: str, name: str) -> str:
        # a shard name is a file name, not a URL: '#', '?', '%', spaces and non-ASCII quoted
        return urllib.parse.urljoin(base, urllib.parse.quote(name))

    # -- opening, from the origin or from the headers kept in the disk tier ------------------
    def _open(self, url: str, pattern: str, disk_cache: str | None):
        """The catalog from the origin; with a disk tier its answers are kept there (kept.py),
        and an origin that does not answer is replaced by the answers kept last time."""
        if not disk_cache:
            return open_catalog(self, url, pattern)
        self._recorder = Recorder(url)
        try:
            cat = open_catalog(self, url, pattern)
        except OriginDown as e:
            self._replay = Replay.load(disk_cache, url)
            if self._replay is None:
                raise OriginDown(f"{e}; no headers of {url} are kept in {disk_cache} to start from (start once "
                                 "while the origin answers)") from None
            log.warning("origin %s does not answer (%s); starting from the headers kept in %s: serving what the "
                        "disk tier holds, the rest once the origin answers", url, e, self._replay.path)
            self.files, self.sizes, self.validators = [], [], []
            self._recorder = None
            cat = open_catalog(self, url, pattern)
            self.origin.went_down(str(e))
        finally:
            self._replay = None
        return cat

    def _keep_headers(self, disk_cache: str) -> None:
        """Save what the origin answered while opening (after the disk tier's lock is held)."""
        rec, self._recorder = self._recorder, None
        if rec is None or not rec.stat_answers:      # opened from the kept headers: keep them as they are
            return
        try:
            rec.save(disk_cache)
        except OSError as e:          # the disk tier still works; only an offline restart would not
            log.warning("cannot keep the headers of %s in %s: %s", self.path, disk_cache, e)

    # -- what headers.open_catalog asks of the origin ---------------------------------------
    def add_file(self, url: str) -> int:
        if self._replay is not None:
            size, validator = self._replay.stat(url)
        else:
            size, validator = self._stat(url)
            if self._recorder is not None:
                self._recorder.keep_stat(url, size, validator)
        self.files.append(url)
        self.sizes.append(size)
        self.validators.append(validator)
        return len(self.files) - 1

    def get_small(self, url: str) -> bytes | None:
        if self._replay is not None:
            return self._replay.small(url)
        data = self._get_small(url)
        if self._recorder is not None:
            self._recorder.keep_small(url, data)
        return data

    def fetch_bytes(self, fi: int, start: int, length: int) -> bytes:
        if self._replay is not None:
            return self._replay.ranges(self.files)(fi, start, length)
        buf = bytearray(length)
        if length:
            self.fetch_into(fi, start, [memoryview(buf)])
        if self._recorder is not None:
            self._recorder.keep_range(self.files[fi], start, bytes(buf))
        return bytes(buf)

    # -- ranged reads with retries -----------------------------------------------------------
    def fetch_into(self, fi: int, start: int, bufs: list[memoryview]) -> int:
        """Fill ``bufs`` with file ``fi``'s bytes from ``start``; retries transient failures."""
        total = sum(len(b) for b in bufs)
        done = 0

        def attempt(n: int) -> None:
            nonlocal done
            self.counters.add("requests")
            try:
                self._get_into(fi, start + done, skip_bytes(bufs, done), n)
            except Retryable as e:
                done += e.progress      # checked bytes already in bufs: ask for the rest
                raise

        def on_retry(n: int, e: Retryable) -> None:
            self.counters.add("retries")
            log.info("retry %d/%d of %s bytes=%d-%d: %s", n, self.retries, self.files[fi],
                     start + done, start + total - 1, e.reason)

        # while the origin is down, one attempt per request: a fetch of what the disk tier
        # lacks fails at once (ReadFailed; the next fetch tries again) instead of backing off
        retries = 0 if not self.origin.up else self.retries
        try:
            retrying(attempt, retries, lambda: f"GET {self.files[fi]} bytes={start}-{start + total - 1}",
                     on_retry)
        except OriginDown as e:
            self.counters.add("errors")
            self.origin.went_down(str(e))
            raise
        except SourceError:
            self.counters.add("errors")
            self.origin.answered()    # it answered, with something no retry mends
            raise
        self.origin.answered()
        return total

    # -- which expert a part belongs to ------------------------------------------------------
    def _build_owners(self):
        per = [[] for _ in self.files]
        for key, ex in self.keys.items():
            for e in ex:
                per[e.file].append((e.offset, e.offset + e.length, key))
        owners = []
        for lst in per:
            lst.sort()
            owners.append(([s for s, _, _ in lst], lst))
        return owners

    def _key_of(self, e: Extent):
        starts, lst = self._owners[e.file]
        i = bisect.bisect_right(starts, e.offset) - 1
        if i < 0 or not (lst[i][0] <= e.offset and e.offset + e.length <= lst[i][1]):
            raise SourceError(f"internal: extent {e} belongs to no expert of {self.path}")
        return lst[i][2]

    def read(self, extents: list[Extent], slot: memoryview) -> int:
        if not extents:
            return 0
        return self.tiers.read(self._key_of(extents[0]), extents, slot)

    def fingerprint(self, key) -> str:
        return self.tiers.fingerprint(key)

    def flush(self, timeout: float = 60.0) -> None:
        """Wait (at most ``timeout`` s) until the write-behind queue has drained: every expert
        fetched so far is then in the disk tier."""
        self.tiers.flush(timeout)

    # -- status --------------------------------------------------------------------------------
    def tier_stats(self) -> dict:
        """Counters of the disk and origin tiers (arena hits are the server's ``stats.hits``)."""
        c = self.counters.snapshot()
        cache = self.tiers.cache
        secs = c.pop("origin_seconds")
        disk = {"hits": c.pop("disk_hits"), "corrupt": c.pop("disk_corrupt"),
                "write_skipped": c.pop("disk_write_skipped"), "write_errors": c.pop("disk_write_errors"),
                "write_backlog_bytes": self.tiers.backlog()}
        if cache is not None:
            disk.update(cache.stats())
        origin = {"url": self.path, "fetches": c["origin_fetches"], "bytes": c["origin_bytes"],
                  "seconds": round(secs, 6), "bps": round(c["origin_bytes"] / secs) if secs else 0,
                  "requests": c["requests"], "retries": c["retries"], "errors": c["errors"],
                  **self.origin.status()}
        return {"disk": disk if cache is not None else None, "origin": origin}

    def describe(self) -> dict:
        d = super().describe()
        d["format"] = self.format
        if self.tensor_types:
            d["tensor_types"] = dict(self.tensor_types)
        d["tiers"] = self.tier_stats()
        return d

    def close(self):
        if self.tiers is not None:
            self.tiers.close()
        super().close()
