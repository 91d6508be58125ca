"""Remote origins: the HTTP(S) Range source, and the base it shares with S3.

``RemoteSource`` turns a remote checkpoint into the ``Source`` interface the
readers use; a transport subclass (``HttpSource`` here, ``S3Source`` in
source_s3.py) supplies three primitives: ``_stat(url)`` (size and validator,
i.e. the ETag, pinned at start), ``_get_small(url)`` (a whole small file: the
index.json) and ``_get_into(fi, start, bufs, attempt)`` (one ranged request
whose body is read with ``readinto`` straight into ``bufs``, slot memory).

What a spec may name (URLs ending in ``/`` are directories)::

    DIR/                  DIR/model.safetensors.index.json + its shards, else DIR/model.safetensors
    .../x.json            a safetensors index;   .../x.safetensors   one file
    .../x.gguf            GGUF (stacked *_exps); .../x.k3pack        packed (crc32-verified)

Headers: each file is stat'ed once (its ETag pinned), then its header bytes
are fetched with ranged GETs and written into a *header image*: a sparse local
temporary file of the remote file's size whose head holds those bytes.  The
local parsers (SafetensorsSource, parse_gguf/GGUFSource, PackedSource) then
validate the image exactly as they would the file and give the layout and
every expert's extents; they only read header bytes, and the image is deleted
right after.  Error messages name the URL, not the image.

Reads: a part (``split_extents`` output) is coalesced into runs of
file-contiguous extents; each run is one single-range GET (never multipart)
whose body lands in the run's slot slices.  With readers >= experts in a
batch, an expert is one part and so one request when its tensors are
adjacent (safetensors writers sort by dtype then name, so usually they are).

Checks on every response (any failure fails that expert's load; the bytes are
never served): status 206, ``Content-Range: bytes a-b/size`` exactly as asked,
``Content-Length`` = b - a + 1, the body exactly that long, the ETag (when
sent) the pinned one.  Requests carry ``If-Match: <pinned ETag>`` (or
``If-Unmodified-Since`` when the origin has only Last-Modified), so a changed
file is a 412: an error naming the file, never a mix of two versions.  A 200
(Range ignored) is an error, not a whole-file download.

Retries: 5xx, 408, 429, connection resets/refusals, timeouts and truncated
bodies are retried up to ``retries`` times with full-jitter exponential
backoff (sleep uniform(0, min(cap, base * 2**n))), resuming after the bytes
already received (they were checked against Content-Range and the ETag).  A
stale pooled keep-alive connection gets one free retry on a fresh connection.
Exhausted retries fail the expert with the URL, range and last status.

Disk tier (``disk_cache``): the first part of a load decides where the
expert comes from (a valid entry -> disk, else origin).  A load's parts are
tracked by the slot memoryview object the server makes per load (as in
packed.py).  Disk parts are pread from the entry file and crc'ed; when the last
part lands the crcs are combined and compared with the entry's: on a mismatch
the entry is deleted and the whole expert is refetched from the origin in
that thread, so a torn entry is never served.  After an origin load completes,
the slot image is copied (the slot may be evicted as soon as read() returns)
and handed to one writer thread that writes the entry (tmp + fsync +
rename); if more than ``WRITE_BACKLOG`` bytes are waiting, the copy is skipped
(counted), so a slow disk never slows fetches.

Thread-safety: ``read`` runs in many reader threads.  Shared mutable state:
the connection pool (its lock + semaphore), the pending-load table and the
counters (``self._mu``), the disk cache index (its own lock), the write queue;
the per-key fingerprint memo is filled idempotently (a racing duplicate
computes the same string).
Lock order: ``_mu`` before the disk cache's lock; no I/O under ``_mu``.
"""

from __future__ import annotations

import abc
import bisect
import http.client
import json
import logging
import os
import queue
import random
import re
import shutil
import socket
import ssl
import tempfile
import threading
import time
import urllib.parse

from ..base import Extent, Source, SourceError, contiguous_runs
from ..checksum import crc32, crc32_of_parts
from .disk_cache import DATA_OFFSET, DiskCache, DiskCacheError

log = logging.getLogger("k3d")

INDEX_NAME = "model.safetensors.index.json"
HEAD_PROBE = 1 << 16          # first header fetch; more only if the header says so
GGUF_HEAD_START = 1 << 20
MAX_HEADER_FETCH = 256 << 20
WRITE_BACKLOG = 512 << 20     # bytes of slot images waiting for the disk writer
BACKOFF_BASE, BACKOFF_CAP = 0.05, 2.0
RETRY_STATUS = {408, 429, 500, 502, 503, 504}
_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)\Z")


class Retryable(Exception):
    """A transient failure of one request; ``progress`` bytes of the body had landed."""

    def __init__(self, reason: str, progress: int = 0, stale: bool = False):
        super().__init__(reason)
        self.reason, self.progress, self.stale = reason, progress, stale


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


class _Load:
    """One expert load in progress: its parts' (slot_offset, length, crc) and where they came from."""
    __slots__ = ("token", "parts", "got", "entry", "t0", "fallback")

    def __init__(self, token, entry):
        self.token, self.parts, self.got, self.entry, self.t0 = token, [], 0, entry, time.perf_counter()
        self.fallback = False     # a part of it came from the origin: its disk entry was unreadable


class RemoteSource(Source, metaclass=abc.ABCMeta):
    kind = "remote"
    max_parts = 1     # one coalesced single-range request per expert

    def __init__(self, url: str, pattern: str, *, disk_cache: str | None = None,
                 disk_cache_size: int = 0, retries: int = 5):
        super().__init__()
        self.path = url
        self.retries = retries
        self.format = "?"
        self.validators: list[dict] = []
        self.sizes: list[int] = []
        self.expected_crc: dict[tuple[int, int], int] = {}
        self.tensor_types: dict = {}
        self._mu = threading.Lock()
        self._pending: dict[tuple[int, int], _Load] = {}
        self.counters = {"disk_hits": 0, "disk_corrupt": 0, "disk_write_skipped": 0, "disk_write_errors": 0,
                         "origin_fetches": 0, "origin_bytes": 0, "origin_seconds": 0.0, "requests": 0,
                         "retries": 0, "errors": 0}
        self.cache: DiskCache | None = None
        self._writer = None
        self._backlog = 0
        self._wq: queue.Queue = queue.Queue()
        self._open(url, pattern)
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
        self._payload = {k: sum(e.length for e in ex) for k, ex in self.keys.items()}
        self._fp = {}
        if disk_cache:
            try:
                self.cache = DiskCache(disk_cache, disk_cache_size)
            except DiskCacheError as e:
                raise SourceError(str(e)) from None
            self._writer = threading.Thread(target=self._write_loop, name="k3d-disk-writer", daemon=True)
            self._writer.start()

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

    def _join(self, base: str, name: str) -> str:
        # a shard name is a file name, not a URL: '#', '?', '%', spaces and non-ASCII quoted
        return urllib.parse.urljoin(base, urllib.parse.quote(name))

    # -- ranged reads with retries -----------------------------------------------------------
    def fetch_into(self, fi: int, start: int, bufs: list[memoryview]) -> int:
        """Fill ``bufs`` with file ``fi``'s bytes from ``start``; retries transient failures."""
        total = sum(len(b) for b in bufs)
        done, attempt, free = 0, 0, True
        while True:
            with self._mu:
                self.counters["requests"] += 1
            try:
                self._get_into(fi, start + done, skip_bytes(bufs, done), attempt)
                return total
            except Retryable as e:
                done += e.progress
                if e.stale and free and not e.progress:
                    free = False       # a keep-alive connection the server had closed: once, no wait
                    continue
                attempt += 1
                if attempt > self.retries:
                    with self._mu:
                        self.counters["errors"] += 1
                    raise SourceError(f"GET {self.files[fi]} bytes={start}-{start + total - 1} failed after "
                                      f"{attempt} attempts: {e.reason}") from None
                with self._mu:
                    self.counters["retries"] += 1
                log.info("retry %d/%d of %s bytes=%d-%d: %s", attempt, self.retries, self.files[fi],
                         start + done, start + total - 1, e.reason)
                time.sleep(random.uniform(0, min(BACKOFF_CAP, BACKOFF_BASE * 2 ** attempt)))
            except SourceError:
                with self._mu:
                    self.counters["errors"] += 1
                raise

    def _fetch_bytes(self, fi: int, start: int, length: int) -> bytes:
        buf = bytearray(length)
        if length:
            self.fetch_into(fi, start, [memoryview(buf)])
        return bytes(buf)

    def _add_file(self, url: str) -> int:
        size, validator = self._stat(url)
        self.files.append(url)
        self.sizes.append(size)
        self.validators.append(validator)
        return len(self.files) - 1

    # -- opening: header images parsed by the local parsers ----------------------------------
    def _open(self, url: str, pattern: str) -> None:
        low = urllib.parse.urlsplit(url).path.lower()
        tmp = tempfile.mkdtemp(prefix="k3d-remote-hdr-")
        self._images: dict[str, str] = {}
        try:
            if low.endswith("/") or low == "":
                base = url if url.endswith("/") else url + "/"
                index = self._get_small(self._join(base, INDEX_NAME))
                if index is not None:
                    self._open_safetensors(self._join(base, INDEX_NAME), index, pattern, tmp)
                else:
                    try:
                        self._open_safetensors(None, [self._join(base, "model.safetensors")], pattern, tmp)
                    except SourceError as e:
                        if "not found" in str(e):
                            raise SourceError(f"{url}: neither {INDEX_NAME} nor model.safetensors there") from None
                        raise
            elif low.endswith(".json"):
                index = self._get_small(url)
                if index is None:
                    raise SourceError(f"{url}: not found")
                self._open_safetensors(url, index, pattern, tmp)
            elif low.endswith(".safetensors"):
                self._open_safetensors(None, [url], pattern, tmp)
            elif low.endswith(".gguf"):
                self._open_gguf(url, tmp)
            elif low.endswith(".k3pack"):
                self._open_packed(url, tmp)
            else:
                raise SourceError(f"unsupported remote source {url}: expected a directory (ending in /), "
                                  "a .json index, a .safetensors, .gguf or .k3pack file")
        except SourceError as e:
            msg = str(e)
            for image, remote in self._images.items():
                msg = msg.replace(image, remote)
            raise SourceError(msg.replace(tmp + "/", "")) from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _image(self, fi: int, prefix: bytes, path: str) -> str:
        with open(path, "wb") as f:
            f.write(prefix)
            f.truncate(self.sizes[fi])     # sparse: the data area takes no disk
        self._images[path] = self.files[fi]
        return path

    def _st_prefix(self, fi: int) -> bytes:
        size = self.sizes[fi]
        head = self._fetch_bytes(fi, 0, min(HEAD_PROBE, size))
        if len(head) >= 8:
            n = int.from_bytes(head[:8], "little")
            from ..safetensors import MAX_HEADER
            if len(head) < 8 + n <= size and n <= MAX_HEADER:
                head += self._fetch_bytes(fi, len(head), 8 + n - len(head))
        return head

    def _open_safetensors(self, index_url, index, pattern, tmp) -> None:
        from ..safetensors import SafetensorsSource
        if index_url is None:
            shard_urls = list(index)
            weight_map = None
        else:
            try:
                weight_map = json.loads(index)["weight_map"]
                names = sorted(set(weight_map.values()))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise SourceError(f"{index_url}: not a usable safetensors index ({e})") from None
            shard_urls = [self._join(index_url, n) for n in names]
        images = []
        for i, u in enumerate(shard_urls):
            fi = self._add_file(u)
            images.append(self._image(fi, self._st_prefix(fi), os.path.join(tmp, f"{i:06d}.safetensors")))
        if weight_map is None:
            target = images[0]
        else:
            local = {n: os.path.basename(images[names.index(s)]) for n, s in weight_map.items()}
            target = os.path.join(tmp, INDEX_NAME)
            with open(target, "w") as f:
                json.dump({"weight_map": local}, f)
        st = SafetensorsSource(target, pattern)
        st.close()
        self.format = "safetensors"
        self.layout, self.keys, self.tensor_format = st.layout, st.keys, st.tensor_format

    def _open_gguf(self, url: str, tmp: str) -> None:
        from ..gguf import GGUFSource, parse_gguf
        fi = self._add_file(url)
        size = self.sizes[fi]
        have = min(size, GGUF_HEAD_START)
        head = self._fetch_bytes(fi, 0, have)
        path = os.path.join(tmp, "image.gguf")
        while True:
            self._image(fi, head, path)
            try:
                data_start, _, _ = parse_gguf(path)
            except SourceError:
                # the header may run past what we fetched (the image is zeros there): fetch more
                if have >= min(size, MAX_HEADER_FETCH):
                    raise
                data_start = None
            if data_start is not None and data_start <= have:
                break
            more = min(size, MAX_HEADER_FETCH, max(have * 4, data_start or 0))
            if more <= have:
                raise SourceError(f"{url}: GGUF header longer than {MAX_HEADER_FETCH} bytes")
            head += self._fetch_bytes(fi, have, more - have)
            have = more
        g = GGUFSource(path)
        g.close()
        self.format = "gguf"
        self.layout, self.keys, self.tensor_format = g.layout, g.keys, g.tensor_format
        self.tensor_types = dict(g.tensor_types)

    def _open_packed(self, url: str, tmp: str) -> None:
        from ..packed import MAX_HEADER, PackedSource
        fi = self._add_file(url)
        size = self.sizes[fi]
        head = self._fetch_bytes(fi, 0, min(size, HEAD_PROBE))
        if len(head) >= 16:
            n = int.from_bytes(head[8:16], "little")
            if len(head) < 16 + n <= min(size, MAX_HEADER):
                head += self._fetch_bytes(fi, len(head), 16 + n - len(head))
        p = PackedSource(self._image(fi, head, os.path.join(tmp, "image.k3pack")), "buffered")
        p.close()
        self.format = "packed"
        self.layout, self.keys, self.tensor_format = p.layout, p.keys, p.tensor_format
        self.tensor_types = dict(p.tensor_types)
        for k, c in zip(p.header["keys"], p.header["checksums"]):
            self.expected_crc[(int(k[0]), int(k[1]))] = int(c, 16)

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

    def fingerprint(self, key) -> str:
        fp = self._fp.get(key)
        if fp is None:
            desc = [[s.name, s.dtype, list(s.shape), s.offset, s.nbytes] for s in self.layout]
            ex = [[self.files[e.file], e.offset, e.slot_offset, e.length] for e in self.keys[key]]
            fp = crc32(json.dumps([self.format, desc, ex]).encode()).to_bytes(4, "big").hex()
            self._fp[key] = fp
        return fp

    def _validators_of(self, key) -> dict:
        return {self.files[fi]: self.validators[fi] for fi in sorted({e.file for e in self.keys[key]})}

    # -- reading -------------------------------------------------------------------------------
    def read(self, extents: list[Extent], slot: memoryview) -> int:
        if not extents:
            return 0
        key = self._key_of(extents[0])
        load = self._begin(key, slot)
        try:
            pieces = self._read_part(load, key, extents, slot)
        except BaseException:
            with self._mu:
                if self._pending.get(key) is load:
                    del self._pending[key]
            raise
        with self._mu:
            if self._pending.get(key) is not load:
                return sum(e.length for e in extents)    # load abandoned (a sibling part failed)
            if pieces is not None:
                load.parts.extend(pieces)
            load.got += sum(e.length for e in extents)
            if load.got < self._payload[key]:
                return sum(e.length for e in extents)
            del self._pending[key]
        self._finish(load, key, slot)
        return sum(e.length for e in extents)

    def _begin(self, key, slot) -> _Load:
        with self._mu:
            load = self._pending.get(key)
            if load is not None and load.token is slot:
                return load
        entry = None
        if self.cache is not None:
            entry = self.cache.lookup(self.path, key, self.fingerprint(key), self._validators_of(key))
        with self._mu:
            load = self._pending.get(key)
            if load is None or load.token is not slot:
                # a new load of this expert: an earlier (failed) load's parts are forgotten
                load = _Load(slot, entry)
                self._pending[key] = load
            return load

    def _padding(self) -> dict[int, int]:
        """{end of a layout tensor: start of the next one} (the gap between is padding only)."""
        pad = getattr(self, "_pad", None)
        if pad is None:
            specs = sorted(self.layout, key=lambda s: s.offset)
            pad = self._pad = {a.offset + a.nbytes: b.offset for a, b in zip(specs, specs[1:])}
        return pad

    def _want_crc(self, load: _Load, key) -> bool:
        return load.entry is not None or key in self.expected_crc

    def _read_part(self, load: _Load, key, extents, slot) -> list | None:
        if load.entry is not None:
            try:
                return self._disk_part(load, extents, slot)
            except OSError as e:
                # gone or unreadable (deleted under the daemon, EIO): the index forgets it and
                # this part comes from the origin; the whole load is still checked against the
                # entry's crc (other parts may have come from disk) and then written back
                log.warning("disk cache entry of expert (layer %d, expert %d) unreadable (%s): "
                            "dropped, reading from %s", key[0], key[1], e, self.path)
                self.cache.discard(self.path, key)
                with self._mu:
                    load.fallback = True
                    self.counters["disk_corrupt"] += 1
        self._origin_read(extents, slot)
        if self._want_crc(load, key):
            return [(e.slot_offset, e.length, crc32(slot[e.slot_offset:e.slot_offset + e.length]))
                    for e in extents]
        return None

    def _disk_part(self, load: _Load, extents, slot) -> list:
        """Read a part from its disk entry; its crcs are checked against the entry's once
        the load is whole (also when another part fell back to the origin)."""
        fd = os.open(load.entry.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)   # a FIFO must not block
        try:
            # the entry is the slot image: one pread per run of extents separated only by
            # the padding between two layout tensors (one ends, the next begins), so a run
            # writes no byte that another part of the load owns
            pad = self._padding()
            runs: list[list[int]] = []
            for e in sorted(extents, key=lambda x: x.slot_offset):
                if runs and (runs[-1][1] == e.slot_offset or pad.get(runs[-1][1]) == e.slot_offset):
                    runs[-1][1] = e.slot_offset + e.length
                else:
                    runs.append([e.slot_offset, e.slot_offset + e.length])
            for lo, hi in runs:
                got = 0
                while got < hi - lo:
                    n = os.preadv(fd, [slot[lo + got:hi]], DATA_OFFSET + lo + got)
                    if n <= 0:
                        break      # a short entry: the crc check in _finish refetches
                    got += n
                # the arena is the cache: a second copy in the page cache only wastes RAM
                os.posix_fadvise(fd, DATA_OFFSET + lo, hi - lo, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return [(e.slot_offset, e.length, crc32(slot[e.slot_offset:e.slot_offset + e.length]))
                for e in extents]

    def _origin_read(self, extents, slot) -> int:
        t0 = time.perf_counter()
        total = 0
        for f, off, bufs in contiguous_runs(extents, slot, max_buffers=1 << 30):
            total += self.fetch_into(f, off, bufs)
        with self._mu:
            self.counters["origin_bytes"] += total
            self.counters["origin_seconds"] += time.perf_counter() - t0
        return total

    @staticmethod
    def _tiles(parts) -> list:
        """Merged (start, end) slot ranges of ``parts``; overlapping parts make it differ."""
        out = []
        for so, length, _ in sorted(parts):
            if out and out[-1][1] == so:
                out[-1][1] = so + length
            else:
                out.append([so, so + length])
        return out

    def _finish(self, load: _Load, key, slot) -> None:
        """The last part of ``key`` landed: verify, count, and write through to disk."""
        from_disk = load.entry is not None
        if self._want_crc(load, key):
            if self._tiles(load.parts) != self._tiles([(e.slot_offset, e.length, 0) for e in self.keys[key]]):
                raise SourceError(f"internal: the parts read of expert {key} do not tile it exactly")
            crc = crc32_of_parts(load.parts)
            if from_disk and crc != load.entry.crc32:
                log.warning("disk cache entry of expert (layer %d, expert %d) fails its crc32 "
                            "(%08x, entry says %08x): dropped, refetching from %s",
                            key[0], key[1], crc, load.entry.crc32, self.path)
                self.cache.discard(self.path, key)
                with self._mu:
                    self.counters["disk_corrupt"] += 1
                self._origin_read(self.keys[key], slot)
                from_disk = False
                crc = self._payload_crc(slot, key) if key in self.expected_crc else None
            want = self.expected_crc.get(key)
            if not from_disk and want is not None and crc != want:
                with self._mu:
                    self.counters["errors"] += 1
                raise SourceError(f"checksum mismatch in expert (layer {key[0]}, expert {key[1]}) of "
                                  f"{self.path}: crc32 {crc:08x}, header says {want:08x}")
        if load.fallback:
            from_disk = False       # verified, but (some of) it came from the origin: write it again
        with self._mu:
            self.counters["disk_hits" if from_disk else "origin_fetches"] += 1
        if not from_disk and self.cache is not None:
            self._write_behind(key, slot)

    def _payload_crc(self, slot, key) -> int:
        crc = 0
        for e in sorted(self.keys[key], key=lambda x: x.slot_offset):
            crc = crc32(slot[e.slot_offset:e.slot_offset + e.length], crc)
        return crc

    # -- write-behind to the disk tier -----------------------------------------------------------
    def _write_behind(self, key, slot) -> None:
        n = self.expert_bytes
        with self._mu:
            if self._backlog + n > WRITE_BACKLOG:
                self.counters["disk_write_skipped"] += 1
                return
            self._backlog += n
        image = bytearray(n)      # zero gaps; the copy frees the slot for eviction right away
        for e in self.keys[key]:
            image[e.slot_offset:e.slot_offset + e.length] = slot[e.slot_offset:e.slot_offset + e.length]
        self._wq.put((key, image))

    def _write_loop(self) -> None:
        while True:
            item = self._wq.get()
            if item is None:
                return
            key, image = item
            try:
                crc = self._payload_crc(memoryview(image), key)
                self.cache.insert(self.path, key, self.fingerprint(key), self._validators_of(key), image, crc)
            except OSError as e:
                log.warning("disk cache: cannot write expert (layer %d, expert %d): %s", key[0], key[1], e)
                with self._mu:
                    self.counters["disk_write_errors"] += 1
            finally:
                with self._mu:
                    self._backlog -= len(image)
                self._wq.task_done()

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until queued disk writes are done (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._writer is not None and time.monotonic() < deadline:
            with self._mu:
                if self._backlog == 0 and self._wq.unfinished_tasks == 0:
                    return
            time.sleep(0.005)

    # -- status --------------------------------------------------------------------------------
    def tier_stats(self) -> dict:
        """Counters of the disk and origin tiers (arena hits are the server's ``stats.hits``)."""
        with self._mu:
            c = dict(self.counters)
            backlog = self._backlog
        secs = c.pop("origin_seconds")
        disk = {"hits": c.pop("disk_hits"), "corrupt": c.pop("disk_corrupt"),
                "write_skipped": c.pop("disk_write_skipped"), "write_errors": c.pop("disk_write_errors"),
                "write_backlog_bytes": backlog}
        if self.cache is not None:
            disk.update(self.cache.stats())
        origin = {"url": self.path, "fetches": c["origin_fetches"], "bytes": c["origin_bytes"],
                  "seconds": round(secs, 6), "bps": round(c["origin_bytes"] / secs) if secs else 0,
                  "requests": c["requests"], "retries": c["retries"], "errors": c["errors"]}
        return {"disk": disk if self.cache is not None else None, "origin": origin}

    def describe(self) -> dict:
        d = super().describe()
        d["format"] = self.format
        if self.tensor_types:
            d["tensor_types"] = dict(self.tensor_types)
        d["tiers"] = self.tier_stats()
        return d

    def close(self):
        if self._writer is not None:
            self.flush(timeout=30)
            self._wq.put(None)
            self._writer.join(timeout=30)
            self._writer = None
        if self.cache is not None:
            self.cache.close()
        with self._mu:
            self._pending = {}
        super().close()


# -- HTTP transport ------------------------------------------------------------------------------
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
        from ... import __version__
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
        attempt, free = 0, True
        while True:
            try:
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
            except Retryable as e:
                if e.stale and free:
                    free = False
                    continue
                attempt += 1
                if attempt > self.retries:
                    raise SourceError(f"{method} {url} failed after {attempt} attempts: {e.reason}") from None
                time.sleep(random.uniform(0, min(BACKOFF_CAP, BACKOFF_BASE * 2 ** attempt)))

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
                self._check_206(resp, url, start, end, fi, where)
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

    def _check_206(self, resp, url, start, end, fi, where) -> None:
        cr = (resp.getheader("Content-Range") or "").strip()
        m = _CONTENT_RANGE.match(cr)
        if not m or int(m[1]) != start or int(m[2]) != end:
            raise SourceError(f"{where}: the response's Content-Range is {cr!r}, not bytes {start}-{end}")
        if m[3] != "*" and int(m[3]) != self.sizes[fi]:
            raise SourceError(f"origin changed: {url} is now {m[3]} bytes, was {self.sizes[fi]} "
                              "at start; restart k3d to serve the new version")
        cl = resp.getheader("Content-Length")
        if cl is None or not cl.strip().isdigit() or int(cl) != end - start + 1:
            raise SourceError(f"{where}: Content-Length {cl!r} is not the {end - start + 1} bytes asked for")
        v = self.validators[fi]
        etag = resp.getheader("ETag")
        if v.get("etag") and etag and etag != v["etag"]:
            raise SourceError(f"origin changed: {url} has ETag {etag!r}, not {v['etag']!r} seen at start; "
                              "restart k3d to serve the new version")
        if not v.get("etag") and v.get("last_modified") and resp.getheader("Last-Modified") \
                and resp.getheader("Last-Modified") != v["last_modified"]:
            raise SourceError(f"origin changed: {url} is now Last-Modified {resp.getheader('Last-Modified')!r}, "
                              f"was {v['last_modified']!r}; restart k3d to serve the new version")

    def close(self):
        super().close()
        for p in self._pools.values():
            p.close()

