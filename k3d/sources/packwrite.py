"""Writing packed files (``.k3pack``, format in packformat.py): ``write_pack(src, out)``.

Every expert of ``src`` is read (``src.read``, any Source) into one zeroed,
page-aligned buffer of ``stride`` bytes and written at ``data_offset + i *
stride``; its crc32 (over the whole stride, padding included) goes into the
header.  Alignment gaps and tail padding stay zero, so checksums are
deterministic.

Crash safety (the invariant ``read_header`` relies on):
- the file is an unnamed ``O_TMPFILE`` in OUT's directory (``_create``), linked
  in as OUT only when complete (``_publish``: linkat of /proc/self/fd/N, or
  beside an existing OUT as ``OUT.partial`` and renamed over it; then the
  directory is fsynced), so an interrupted pack leaves no file at all;
- where the file system has no O_TMPFILE the file is ``OUT.partial``, which
  ``k3d start`` refuses by name;
- the data is written and fsynced before the header (zero bytes until then),
  so a header on disk never describes experts that are not.

The header's size is fixed before the data is written: checksums are
fixed-width hex, so a placeholder header has the final length and
``data_offset`` is reserved from it.

Thread: the caller's (``k3d pack`` on the main thread, tests, benchmarks); ``src``
must not be read by anyone else meanwhile.  ``progress=True`` draws a bar on
stderr (in place on a terminal, a line per 10 % otherwise).
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import sys
import time

from k3client.layout import align

from .base import PAGE, Source, SourceError
from .checksum import crc32
from .packformat import FORMAT, MAGIC, PARTIAL, VERSION


class _Progress:
    """A progress bar on stderr: redrawn in place on a terminal, a line per 10% otherwise."""

    def __init__(self, total: int, nbytes: int, out=None):
        self.total, self.nbytes, self.out = total, nbytes, out or sys.stderr
        self.tty = self.out.isatty()
        self.t0 = self.last = time.monotonic()
        self.decile = -1

    def update(self, done: int, final: bool = False) -> None:
        now = time.monotonic()
        frac = done / self.total if self.total else 1.0
        if not final:
            if self.tty and now - self.last < 0.1:
                return
            if not self.tty and int(frac * 10) == self.decile:
                return
        self.last, self.decile = now, int(frac * 10)
        rate = done * self.nbytes / max(now - self.t0, 1e-9) / 1e6
        bar = "#" * int(frac * 30)
        line = f"k3d pack: [{bar:<30}] {frac * 100:5.1f}% {done}/{self.total} experts {rate:7.0f} MB/s"
        if self.tty:
            self.out.write("\r" + line + ("\n" if final else ""))
        else:
            self.out.write(line + "\n")
        self.out.flush()


def _header_bytes(src: Source, keys, span, stride, data_offset, sums) -> bytes:
    h = {"format": FORMAT, "version": 1 if src.uniform else VERSION, "tensor_format": src.tensor_format,
         "source": {"kind": src.kind, "path": os.path.abspath(src.path)},
         "layout": [s.to_wire() for s in src.layout], "span": span, "stride": stride,
         "data_offset": data_offset,
         "layers": sorted({l for l, _ in keys}), "experts": sorted({e for _, e in keys}),
         "keys": [list(k) for k in keys], "checksum": "crc32", "checksums": sums}
    types = getattr(src, "tensor_types", None)
    if types:
        h["tensor_types"] = types
    if not src.uniform:
        h["layouts"] = src.layout_groups()
    d = src.describe()
    if d.get("family"):
        h["family"] = {k: d.get(k) for k in ("family", "family_rule", "top_k")}
    return json.dumps(h, separators=(",", ":")).encode()


def _pwrite_fully(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        with data[done:] as rest:
            done += os.pwrite(fd, rest, offset + done)


def _create(out: str) -> tuple[int, str | None]:
    """The fd a pack is written to, and its name (None: it has none yet).

    O_TMPFILE makes a file with no name until ``_publish`` links it in, so a killed
    pack leaves nothing behind and two packs to one OUT never share a file.  Where
    the file system lacks it: ``OUT.partial``, refused by ``read_header``."""
    if os.path.isdir("/proc/self/fd"):      # linkat needs /proc to name the fd
        try:
            return os.open(os.path.dirname(os.path.abspath(out)),
                           os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o644), None
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
    partial = out + PARTIAL
    return os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644), partial


def _publish(fd: int, name: str | None, out: str) -> str:
    """Give the finished pack the name ``out`` (atomically: complete or not there at all)
    and make the name durable (fsync of the directory)."""
    dfd = os.open(os.path.dirname(os.path.abspath(out)), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if name is None:
            # linkat(AT_SYMLINK_FOLLOW) of /proc/self/fd/N: Python calls linkat (not link,
            # which would not follow the magic link) only when given a dir fd
            base, proc = os.path.basename(out), f"/proc/self/fd/{fd}"
            try:
                os.link(proc, base, dst_dir_fd=dfd, follow_symlinks=True)
                name = out
            except FileExistsError:                     # --force over an existing OUT:
                name = out + PARTIAL                    # link beside it, then rename over it
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name)
                os.link(proc, base + PARTIAL, dst_dir_fd=dfd, follow_symlinks=True)
        if name != out:
            try:
                os.rename(name, out)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(name)
                raise
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return out


def write_pack(src: Source, out: str, progress: bool = True) -> dict:
    """Write ``src`` as a packed file at ``out`` (atomically); returns a summary."""
    keys = sorted(src.keys)
    if not keys:
        raise SourceError(f"{src.path}: no experts to pack")
    span = src.expert_bytes
    if not span:
        raise SourceError(f"{src.path}: the experts' tensors hold no bytes; nothing to pack")
    stride = align(span, PAGE)
    # checksums are fixed-width hex, so the placeholder header has the final length
    placeholder = _header_bytes(src, keys, span, stride, 0, ["0" * 8] * len(keys))
    data_offset = align(16 + len(placeholder) + 32, PAGE)  # +32: room for data_offset's digits
    fd, name = _create(out)             # name: None while the file has none (O_TMPFILE)
    bar = _Progress(len(keys), stride) if progress else None
    t0 = time.monotonic()
    try:
        os.ftruncate(fd, data_offset + len(keys) * stride)
        # one zeroed, page-aligned buffer: every expert writes the same tensor ranges, so
        # the alignment gaps and the tail padding stay zero (checksums are deterministic)
        buf = mmap.mmap(-1, stride)
        view = memoryview(buf)
        sums = []
        try:
            for i, key in enumerate(keys):
                src.read(src.keys[key], view)
                sums.append(f"{crc32(view):08x}")
                _pwrite_fully(fd, view, data_offset + i * stride)
                if bar:
                    bar.update(i + 1, final=i + 1 == len(keys))
        finally:
            view.release()
            buf.close()
        header = _header_bytes(src, keys, span, stride, data_offset, sums)
        if 16 + len(header) > data_offset:
            raise SourceError(f"{out}: header grew past its reserved space (internal error)")
        # The data is on disk before the header is written: a header, once on disk, never
        # describes experts that are not.
        os.fsync(fd)
        blob = MAGIC + len(header).to_bytes(8, "little") + header
        _pwrite_fully(fd, memoryview(blob + bytes(data_offset - len(blob))), 0)
        os.fsync(fd)
        name = _publish(fd, name, out)
    except BaseException:
        if name is not None and name != out:
            with contextlib.suppress(OSError):
                os.unlink(name)
        raise
    finally:
        os.close(fd)
    return {"path": out, "experts": len(keys), "span": span, "stride": stride,
            "bytes": data_offset + len(keys) * stride, "seconds": time.monotonic() - t0}


