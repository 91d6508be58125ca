"""The content digest of what a source serves (``k3client.digest``'s rule), computed and cached.

``compute`` reads, for every expert tensor of every expert, the bytes the rule
samples (at most 32 KiB a tensor), mapping each sampled range of the slot onto
the expert's extents: the file bytes the daemon would read into that part of
the slot.  So every kind of source (safetensors, GGUF, packed, HTTP, S3) gives
the digest of the bytes it serves, and a pack gives its source's digest.  The
reads of one expert are merged where file-contiguous (remote: also across gaps
of at most ``REMOTE_GAP`` bytes, one request instead of several) and run on a
thread pool (``threads_for``: the reader count, at least ``LOCAL_THREADS`` for
local files, whose scattered 4 KiB reads are latency-bound); local files are read with ``pread`` on
descriptors of their own (the very files the source opened, readahead off, the
pages dropped after: the arena is the cache), remote ones with the source's
retrying ``fetch_into`` (the disk tier is bypassed: it holds whole experts only).

Cache: ``<state_dir>/digest-<key>.json``, ``key`` a hash of the files' identity
(local: path, st_dev, st_ino, st_size, st_mtime_ns as the source opened it;
remote: URL, size and validator — ETag or Last-Modified) and of the layout the
source found (kind, keys, layouts), so a restart on the same files reads
nothing and a changed file (or ``--pattern``) computes anew.  A file written
in place since the source opened it (``unchanged``, before and after the
reads) is refused (``SourceError``: the digest's ``error``), never digested:
the arena may hold its old bytes.  Writes are atomic
(temporary file + rename).  ``prune`` (after a new digest is saved) deletes only
the cached digests of local checkpoints whose files are gone or changed, which no
start can use again, and crashed saves' temporary files; it touches no other
file (warm-restart state is ``k3d.cache.warm``'s, whose prune leaves these alone).

When: a cached digest is read at start, before ready (``cached``); one to
compute is computed after ready by ``AfterReady`` (a thread, its pool at nice
10), since it reads every expert's samples (6 s for DeepSeek-V3's 14,848
experts on the 2-core VM, before the arena is even touched).  Until it is done
``source.digest`` is ``{"rule", "pending": True, "done", "total"}`` (experts),
which ``hello`` and ``status`` carry as they find it; ``Client.verify`` waits
for the digest while it is pending.

Thread: ``for_source`` runs on the calling thread (``AfterReady``'s), its pool
threads only read the (read-only) source, through descriptors of their own or
the source's thread-safe ``fetch_into``; ``source.digest`` is replaced whole
(one attribute store: readers see the old dict or the new one).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

from k3client.digest import RULE, assemble, sample_ranges, tensor_hash
from k3d import statefile

from .base import PAGE, SourceError, read_fully
from .identity import Identity, difference

log = logging.getLogger("k3d")

FORMAT, VERSION = "k3d-digest-cache", 1
REMOTE_GAP = 256 << 10          # a remote request per gap this size or larger; smaller gaps are read through
# Local sampling is scattered 4 KiB reads: latency-bound, not CPU- or bandwidth-bound, so it
# wants more reads in flight than the reader count (bench/digest_cost.py, 2-core VM, 1.2 GB:
# 4 threads 0.37x the sequential full read's time, 16 threads 0.08x).
LOCAL_THREADS = 16


def identity(source) -> list:
    """What makes the cached digest this source's: the files as opened, and the layout found."""
    if getattr(source, "validators", None) is not None and not source.fds:      # remote
        files = [[url, size, sorted((v or {}).items())]
                 for url, size, v in zip(source.files, source.sizes, source.validators)]
    else:
        # the files as the source opened them (``source.identities``): what it serves, even
        # where one was written since (``unchanged`` then refuses to compute)
        ids = getattr(source, "identities", None) or [Identity.of(os.fstat(fd)) for fd in source.fds]
        files = [[os.path.abspath(path), *i] for path, i in zip(source.files, ids)]
    layout = hashlib.blake2b(repr((source.kind, sorted(source.keys),
                                   [(l, source.layout_of(l)) for l in sorted({k[0] for k in source.keys})])).encode(),
                             digest_size=16).hexdigest()
    return [RULE, source.kind, files, layout]


def cache_path(state_dir: str, ident: list) -> str:
    key = hashlib.blake2b(json.dumps(ident, default=str).encode(), digest_size=8).hexdigest()
    return os.path.join(state_dir, f"digest-{key}.json")


def load_cached(path: str, ident: list) -> dict | None:
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    if (not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION
            or doc.get("identity") != json.loads(json.dumps(ident, default=str))):
        return None
    d = doc.get("digest")
    return d if isinstance(d, dict) and d.get("rule") == RULE and isinstance(d.get("parts"), list) else None


def save_cached(path: str, ident: list, digest: dict) -> None:
    doc = {"format": FORMAT, "version": VERSION, "identity": ident,
           "digest": {k: digest[k] for k in ("rule", "hex", "parts")}}
    statefile.write_json(path, doc, prefix=".digest-", default=str)


def _pieces(extents, start: int, length: int, dest: int):
    """``(file, file offset, dest offset, length)`` covering slot bytes [start, start + length)."""
    out, end, covered = [], start + length, 0
    for e in extents:
        lo, hi = max(start, e.slot_offset), min(end, e.slot_offset + e.length)
        if lo < hi:
            out.append((e.file, e.offset + lo - e.slot_offset, dest + lo - start, hi - lo))
            covered += hi - lo
    if covered != length:
        raise SourceError(f"internal: slot bytes [{start}, {end}) are not all in the expert's extents")
    return out


def _expert_hashes(source, key, fds) -> tuple[dict[str, bytes], int]:
    """{name: tensor_hash} of one expert, and the bytes read for it."""
    extents = source.keys[key]
    layout = source.layout_of(key[0])
    wanted, ranges, size = [], [], 0
    for spec in layout:
        rs = sample_ranges(spec.nbytes)
        wanted.append((spec, [n for _, n in rs]))
        for s, n in rs:
            ranges.extend(_pieces(extents, spec.offset + s, n, size))
            size += n
    buf = bytearray(size)
    view = memoryview(buf)
    gap = REMOTE_GAP if fds is None else 0
    ranges.sort()
    nread, i = 0, 0
    while i < len(ranges):
        fi, off, _, _ = ranges[i]
        end, j = off + ranges[i][3], i + 1
        while j < len(ranges) and ranges[j][0] == fi and ranges[j][1] - end <= gap:
            end = max(end, ranges[j][1] + ranges[j][3])
            j += 1
        run = ranges[i:j]
        if len(run) == 1:
            _read(source, fi, off, [view[run[0][2]:run[0][2] + run[0][3]]], fds)
        else:
            tmp = bytearray(end - off)
            _read(source, fi, off, [memoryview(tmp)], fds)
            for _, o, d, n in run:
                view[d:d + n] = tmp[o - off:o - off + n]
        nread += end - off
        i = j
    out, pos = {}, 0
    for spec, rs in wanted:
        chunks = []
        for n in rs:
            chunks.append(view[pos:pos + n])
            pos += n
        out[spec.name] = tensor_hash(spec.nbytes, chunks)
    return out, nread


def _read(source, fi: int, off: int, bufs, fds) -> None:
    if fds is None:
        source.fetch_into(fi, off, bufs)
        return
    n = read_fully(fds[fi], bufs, off, source.files[fi])
    lo = off // PAGE * PAGE             # whole pages: DONTNEED keeps partial ones
    os.posix_fadvise(fds[fi], lo, -(-(off + n - lo) // PAGE) * PAGE, os.POSIX_FADV_DONTNEED)


def unchanged(source) -> None:
    """SourceError unless every local file is still as the source opened it (``source.identities``).

    Checked before and after the samples are read: the arena may hold experts read before a
    write in place, so a digest of the new bytes would verify a checkpoint the daemon does
    not serve (and one read across the write would match neither)."""
    for path, fd, was in zip(source.files, source.fds, getattr(source, "identities", None) or []):
        what = difference(was, Identity.of(os.fstat(fd)))
        if what is not None:
            # not identity.message's words: the file watch logs those once, and only once
            raise SourceError(f"{path}: written since k3d opened it ({what}), so no digest of the bytes "
                              "it serves; restart k3d to serve and verify the new checkpoint")


def _open_local(source) -> list[int]:
    """Own descriptors on the source's files, readahead off (a sampled block must not pull in
    its neighbours), checked to be the very files the source opened."""
    fds = []
    try:
        for path, sfd in zip(source.files, source.fds):
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            fds.append(fd)
            a, b = os.fstat(fd), os.fstat(sfd)
            if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
                raise SourceError(f"{path}: replaced since k3d opened it; start again")
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def _nice():
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except OSError:
        pass                              # not allowed here: the default priority


def compute(source, threads: int, progress=None, nice: bool = False) -> tuple[dict, int]:
    """The digest of ``source`` (``k3client.digest.assemble``'s dict) and the bytes read.

    ``progress(done, total)`` is called on the calling thread as experts finish (it may
    raise to stop: the experts not begun are cancelled); ``nice``: the pool runs at nice 10."""
    unchanged(source)
    fds = _open_local(source) if source.fds else None       # None: a remote source, read by fetch_into
    layers = sorted({l for l, _ in source.keys})
    specs = {l: [(s.name, s.dtype, s.shape) for s in source.layout_of(l)] for l in layers}
    hashes, nread = {}, 0
    keys = sorted(source.keys)
    try:
        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="k3d-digest",
                                initializer=_nice if nice else None) as pool:
            futures = {pool.submit(_expert_hashes, source, k, fds): k for k in keys}
            try:
                for n, fut in enumerate(as_completed(futures), 1):
                    hashes[futures[fut]], got = fut.result()
                    nread += got
                    if progress is not None and (n % 256 == 0 or n == len(keys)):
                        progress(n, len(keys))
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
    finally:
        for fd in fds or []:
            os.close(fd)
    unchanged(source)
    return assemble(specs, hashes), nread


def threads_for(source, readers: int) -> int:
    """Digest threads: the reader count; for local files at least ``LOCAL_THREADS``."""
    return max(readers, LOCAL_THREADS) if source.fds else readers


def prune(state_dir: str, keep: str) -> list[str]:
    """Delete the cached digests of local checkpoints that are gone or changed (a file missing, or
    another inode, size or mtime: that digest can never be used again), and temporary files of
    saves that crashed over an hour ago; never ``keep``, never a remote source's.  Returns the
    paths deleted."""
    gone, now = [], time.time()
    try:
        names = os.listdir(state_dir)
    except OSError:
        return gone
    for name in names:
        path = os.path.join(state_dir, name)
        try:
            if name.startswith(".digest-") and name.endswith(".tmp"):
                if now - os.stat(path).st_mtime > 3600:
                    gone.append(path)
                continue
            if not (name.startswith("digest-") and name.endswith(".json")) or path == keep:
                continue
            with open(path) as f:
                files = json.load(f)["identity"][2]
            if any(len(f) == 5 and not _same_file(*f) for f in files):
                gone.append(path)
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            continue                  # another daemon's save in flight, or not ours to judge
    for path in gone:
        try:
            os.unlink(path)
        except OSError:
            pass
    return gone


def _same_file(path, dev, ino, size, mtime_ns) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) == (dev, ino, size, mtime_ns)


def cached(source, state_dir: str) -> dict | None:
    """The source's digest from the cache in ``state_dir`` when the files are the same, else None."""
    t0 = time.monotonic()
    ident = identity(source)
    path = cache_path(state_dir, ident) if state_dir else ""
    found = load_cached(path, ident) if path else None
    if found is None:
        return None
    log.info("digest %s of %s: from %s (same files)", found["hex"][:16], source.path, path)
    return {**found, "cached": True, "bytes_read": 0, "seconds": round(time.monotonic() - t0, 3)}


def for_source(source, state_dir: str, threads: int, progress=None, nice: bool = False) -> dict:
    """The source's digest, from the cache in ``state_dir`` when the files are the same,
    else computed (and cached) on ``threads`` threads; logs time and bytes.  Never raises
    for a cache it cannot use or write (a log line); a source it cannot read raises
    (SourceError, OSError)."""
    found = cached(source, state_dir)
    if found is not None:
        return found
    t0 = time.monotonic()
    ident = identity(source)
    path = cache_path(state_dir, ident) if state_dir else ""
    digest, nread = compute(source, threads, progress, nice)
    secs = time.monotonic() - t0
    log.info("digest %s of %s: %d expert tensors, %d bytes read in %.2fs (%d threads)",
             digest["hex"][:16], source.path, sum(p[4] for p in digest["parts"]), nread, secs, threads)
    if path:
        try:
            save_cached(path, ident, digest)
            for old in prune(state_dir, path):
                log.info("digest cache: removed %s (its checkpoint's files are gone or changed)", old)
        except OSError as e:
            log.warning("cannot keep the digest in %s: %s (the next start computes it again)", path, e)
    return {**digest, "cached": False, "bytes_read": nread, "seconds": round(secs, 3)}


class _Stopped(Exception):
    pass


class AfterReady:
    """The digest computed on a thread of its own once the daemon serves.

    ``__init__`` sets ``source.digest`` to the pending dict; ``start`` begins;
    ``stop`` (before the source closes) ends it at the next expert finished and joins.
    A source it cannot read gives ``{"rule", "error"}`` (a warning in the log), as a
    start would have: ``Client.verify`` then refuses in one line naming it.  Any other
    exception does too (logged with its traceback): the digest never stays pending."""

    def __init__(self, source, state_dir: str, threads: int):
        self.source, self.state_dir, self.threads = source, state_dir, threads
        self._stop = threading.Event()
        self._thread = None
        source.digest = {"rule": RULE, "pending": True, "done": 0, "total": len(source.keys)}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="k3d-digest-after-ready", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _tick(self, done: int, total: int) -> None:
        if self._stop.is_set():
            raise _Stopped()
        self.source.digest = {"rule": RULE, "pending": True, "done": done, "total": total}

    def _run(self) -> None:
        try:
            d = for_source(self.source, self.state_dir, self.threads, self._tick, nice=True)
        except _Stopped:
            return
        except (SourceError, OSError) as e:
            log.warning("cannot compute the content digest of %s: %s (clients cannot verify it)", self.source.path, e)
            d = {"rule": RULE, "error": str(e)}
        except Exception as e:   # noqa: BLE001 -- a bug: said, never left "pending" for verify to wait on
            log.exception("the content digest of %s failed (clients cannot verify it)", self.source.path)
            d = {"rule": RULE, "error": f"its content digest failed: {e!r}"}
        self.source.digest = d
