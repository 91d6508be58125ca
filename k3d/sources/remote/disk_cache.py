"""Disk tier for remote sources: experts fetched from an origin, kept as files.

Directory layout (``--disk-cache DIR``)::

    DIR/.lock                    flock'ed by the one daemon using DIR (a second one is refused)
    DIR/<name>.k3e               one entry per expert; <name> = sha256(origin id, layer, expert)[:32]
    DIR/.tmp-<name>-<pid>-<n>    an entry being written (removed at start: never read)

Entry file::

    offset 0     b"K3DCACHE"                 8-byte magic
    offset 8     u32 little-endian version (1), u32 header length H
    offset 16    H bytes of JSON: {"origin", "key": [l, e], "fp", "validators", "bytes", "crc32"}
                 zero padding to 4096
    offset 4096  the slot image: ``bytes`` bytes, tensors at their layout offsets,
                 alignment gaps zero; file size is exactly 4096 + bytes

``fp`` fingerprints the layout and the expert's extents in the origin files,
``validators`` holds each origin file's ETag (or size + Last-Modified) as seen
when the bytes were fetched; ``crc32`` is over the expert's payload (its extents'
bytes in slot-offset order, gaps excluded), the same crc the source computes
over what lands in the slot.

Invariants:
- Crash safety: an entry is written to a ``.tmp-`` file, fsynced, renamed to its
  final name and the directory fsynced.  A ``kill -9`` mid-write leaves only a
  ``.tmp-`` file, which is never opened as an entry and is deleted at the next
  start.  Even a torn or bit-rotted entry is never served: the source checks
  the payload crc after every disk read and refetches from the origin on a
  mismatch (and the entry is dropped).
- Validity: ``lookup`` returns an entry only if its origin, fingerprint and
  validators equal the caller's (the origin's current ETags); a changed origin
  makes old entries misses, and they are deleted when looked up.
- Size bound: the sum of entry file sizes stays <= ``limit``; inserting evicts
  least recently used entries first (recency: in memory while running, the file
  mtime across restarts: a hit touches it).

Thread-safety: ``lookup``/``insert``/``discard`` are called from reader threads;
the index is guarded by one lock, held for dictionary work and the unlinks of
evicted entries only (an insert writes and fsyncs its file outside it, then
adds the entry).  One writer thread inserts (the write-behind in tiers.py).
Built on the main thread with the remote source; ``close`` (main thread, after
the writer drained) releases the directory lock.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

log = logging.getLogger("k3d")

MAGIC = b"K3DCACHE"
VERSION = 1
DATA_OFFSET = 4096
SUFFIX = ".k3e"


class DiskCacheError(Exception):
    """The cache directory cannot be used (the message says why)."""


@dataclass
class Entry:
    name: str
    path: str
    size: int          # file bytes (what counts against the limit)
    crc32: int
    nbytes: int        # slot image bytes


def entry_name(origin: str, key: tuple[int, int]) -> str:
    return hashlib.sha256(f"{origin}\0{key[0]}\0{key[1]}".encode()).hexdigest()[:32]


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def read_entry_header(path: str) -> dict | None:
    """The entry's JSON header, or None if the file is not a whole, well-formed entry."""
    try:
        with open(path, "rb") as f:
            head = f.read(DATA_OFFSET)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return None
    if len(head) < 16 or head[:8] != MAGIC or int.from_bytes(head[8:12], "little") != VERSION:
        return None
    n = int.from_bytes(head[12:16], "little")
    if 16 + n > DATA_OFFSET:
        return None
    try:
        h = json.loads(head[16:16 + n])
        if not isinstance(h, dict) or size != DATA_OFFSET + int(h["bytes"]):
            return None
        int(h["crc32"], 16)
    except (ValueError, KeyError, TypeError):
        return None
    h["_size"] = size
    return h


class DiskCache:
    def __init__(self, directory: str, limit: int):
        self.dir = os.path.abspath(directory)
        self.limit = limit
        try:
            os.makedirs(self.dir, exist_ok=True)
            self._lock_fd = os.open(os.path.join(self.dir, ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise DiskCacheError(f"disk cache {self.dir}: {e.strerror}") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise DiskCacheError(f"disk cache {self.dir} is in use by another k3d (its .lock is held); "
                                 "give each daemon its own --disk-cache directory") from None
        self._mu = threading.Lock()
        self._lru: OrderedDict[str, Entry] = OrderedDict()   # oldest first
        self._headers: dict[str, dict] = {}
        self._seq = itertools.count()
        self.bytes = 0
        self.evictions = 0
        self.writes = 0
        self.write_bytes = 0
        self._scan()

    def _scan(self) -> None:
        found = []
        for fname in os.listdir(self.dir):
            path = os.path.join(self.dir, fname)
            if fname.startswith(".tmp-"):
                # only the lock holder writes here, so a tmp file is a dead writer's
                try:
                    os.unlink(path)
                except OSError:
                    pass
                continue
            if not fname.endswith(SUFFIX):
                continue
            h = read_entry_header(path)
            if h is None:
                log.warning("disk cache: removing malformed entry %s", path)
                self._unlink(path)
                continue
            try:
                mtime = os.stat(path).st_mtime_ns
            except OSError:
                continue
            found.append((mtime, fname[:-len(SUFFIX)], path, h))
        for _, name, path, h in sorted(found):
            self._lru[name] = Entry(name, path, h["_size"], int(h["crc32"], 16), int(h["bytes"]))
            self._headers[name] = h
            self.bytes += h["_size"]
        with self._mu:
            self._evict_to(self.limit)
        if self._lru:
            log.info("disk cache %s: %d entries, %.1f MiB", self.dir, len(self._lru), self.bytes / 2**20)

    @staticmethod
    def _unlink(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:        # a read-only or vanished directory: the index forgets it anyway
            log.warning("disk cache: cannot remove %s: %s", path, e)

    def _evict_to(self, limit: int) -> None:
        # caller holds _mu
        while self._lru and self.bytes > limit:
            name, e = self._lru.popitem(last=False)
            self._headers.pop(name, None)
            self.bytes -= e.size
            self.evictions += 1
            self._unlink(e.path)

    def lookup(self, origin: str, key, fp: str, validators: dict) -> Entry | None:
        """The valid entry for ``key`` (touched as most recent), or None."""
        name = entry_name(origin, key)
        with self._mu:
            e = self._lru.get(name)
            if e is None:
                return None
            h = self._headers[name]
            if h.get("origin") != origin or h.get("key") != list(key) or h.get("fp") != fp \
                    or h.get("validators") != validators:
                stale = True
            else:
                stale = False
                self._lru.move_to_end(name)
            if stale:
                self._drop(name)
                return None
        try:
            os.utime(e.path)     # recency survives a restart
        except OSError:
            pass
        return e

    def _drop(self, name: str) -> None:
        # caller holds _mu
        e = self._lru.pop(name, None)
        self._headers.pop(name, None)
        if e is not None:
            self.bytes -= e.size
            self._unlink(e.path)

    def discard(self, origin: str, key) -> None:
        """Forget and delete ``key``'s entry (its bytes failed the crc check)."""
        with self._mu:
            self._drop(entry_name(origin, key))

    def insert(self, origin: str, key, fp: str, validators: dict, image, crc32: int) -> bool:
        """Write ``image`` (the slot image) as ``key``'s entry, atomically; False if it cannot fit."""
        size = DATA_OFFSET + len(image)
        if size > self.limit:
            return False
        name = entry_name(origin, key)
        header = {"origin": origin, "key": list(key), "fp": fp, "validators": validators,
                  "bytes": len(image), "crc32": f"{crc32:08x}"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        if 16 + len(raw) > DATA_OFFSET:
            return False
        head = MAGIC + VERSION.to_bytes(4, "little") + len(raw).to_bytes(4, "little") + raw
        final = os.path.join(self.dir, name + SUFFIX)
        tmp = os.path.join(self.dir, f".tmp-{name}-{os.getpid()}-{next(self._seq)}")
        # make room first, so the bound holds while the new file exists
        with self._mu:
            self._drop(name)
            self._evict_to(self.limit - size)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            _pwrite_all(fd, memoryview(head + bytes(DATA_OFFSET - len(head))), 0)
            with memoryview(image) as mv:
                _pwrite_all(fd, mv, DATA_OFFSET)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)   # written for later, not for now
            os.close(fd)
            fd = -1
            os.rename(tmp, final)
            _fsync_dir(self.dir)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            self._unlink(tmp)
            raise
        header["_size"] = size
        with self._mu:
            self._drop_index_only(name)
            self._evict_to(self.limit - size)
            self._lru[name] = Entry(name, final, size, crc32, len(image))
            self._headers[name] = header
            self.bytes += size
            self.writes += 1
            self.write_bytes += len(image)
        return True

    def _drop_index_only(self, name: str) -> None:
        e = self._lru.pop(name, None)
        self._headers.pop(name, None)
        if e is not None:
            self.bytes -= e.size

    def stats(self) -> dict:
        with self._mu:
            return {"dir": self.dir, "limit": self.limit, "bytes": self.bytes, "entries": len(self._lru),
                    "writes": self.writes, "write_bytes": self.write_bytes, "evictions": self.evictions}

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
