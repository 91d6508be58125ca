"""Sources: where expert bytes come from.  ``open_source`` is the one place that names kinds.

- ``base``: the ``Source`` interface (layout, keys -> extents, ``read``), ``Extent``,
  ``SourceError``, pread helpers;
- ``safetensors``, ``gguf``, ``packed``: local formats, one reader each;
  ``packwrite`` writes packed files (``k3d pack`` itself is ``k3d.commands.pack``);
- ``checksum``: crc32 (zlib-ng), part combination, the per-reader crc pipeline;
- ``digest``: the content digest of what a source serves (``k3client.digest``'s rule:
  layout and sampled bytes), computed at start-up and cached in the state directory;
- ``identity``: each local file's identity, recorded as it opens, and the watch
  the server checks it with (a file changed while served);
- ``remote/``: HTTP(S) and S3 origins: header images, the tiers (disk cache,
  crc, write-behind), one retry loop and response check, the transports.

Imports run one way: this module imports every kind, and no module below it
imports this one back (code that needs ``open_source`` lives outside the
package: ``k3d.commands.pack``, the daemon).

Dispatch: ``http://``, ``https://``, ``s3://`` -> ``open_remote``; a local
file by its magic (``K3DPACK``, ``GGUF``), else by its extension; a directory
is a safetensors checkpoint.

Thread: sources are built on the main thread before the server starts; after
that they are read-only and ``read`` runs on reader threads.  Caller's
obligation: ``close()`` once the reader pool has stopped.
"""

from __future__ import annotations

import os

from ..config import Config
from .base import Extent, Source, SourceError
from .gguf import MAGIC as GGUF_MAGIC, GGUFSource
from .identity import record
from .packed import PackedSource
from .packformat import MAGIC as PACK_MAGIC, PARTIAL
from .remote.http import HttpSource
from .remote.s3 import S3Source
from .safetensors import SafetensorsSource

__all__ = ["Extent", "Source", "SourceError", "open_remote", "open_source"]


def open_source(spec: str, pattern: str, read_mode: str = "buffered", cfg: Config | None = None) -> Source:
    """``_open``, and the identities of the files it opened (``identity.record``): what
    the server compares each file with while it serves (``identity.FileWatch``)."""
    src = _open(spec, pattern, read_mode, cfg)
    src.identities = record(src.fds)
    return src


def _open(spec: str, pattern: str, read_mode: str = "buffered", cfg: Config | None = None) -> Source:
    """Pick the source for a path (directory or file) or URL; raises SourceError.

    Files are recognised by their magic (``GGUF``, ``K3DPACK``), else by extension;
    ``read_mode`` (buffered | direct) applies to packed files, whose experts are
    4096-aligned; direct reads of other formats are refused.  ``http(s)://`` and
    ``s3://`` specs are remote sources (``remote/``) configured
    from ``cfg`` (connections, timeouts, retries, the disk cache tier).
    """
    if spec.startswith(("http://", "https://", "s3://")):
        if read_mode == "direct":
            raise SourceError(f"--read-mode direct reads local packed files; {spec} is remote "
                              "(its disk cache tier reads buffered)")
        return open_remote(spec, pattern, cfg)
    if not os.path.exists(spec):
        raise SourceError(f"checkpoint not found: {spec}")
    head = b""
    if os.path.isfile(spec):
        fd = os.open(spec, os.O_RDONLY | os.O_CLOEXEC)
        try:
            # no readahead: its window would leave a PG_readahead mark that later sets off
            # async readahead of expert pages the reads never asked for (see packed.py)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            head = os.pread(fd, 8, 0)
        finally:
            os.close(fd)
    if head == PACK_MAGIC or spec.endswith((".k3pack", PARTIAL)):   # PackedSource refuses a .partial
        return PackedSource(spec, read_mode)
    if read_mode not in ("buffered", "direct"):
        raise SourceError(f"unknown read mode {read_mode!r} (use buffered or direct)")
    if read_mode == "direct":
        raise SourceError(f"--read-mode direct needs a packed file (4096-aligned experts); "
                          f"convert {spec} with `k3d pack {spec} OUT.k3pack`")
    if head[:4] == GGUF_MAGIC or spec.endswith(".gguf"):
        return GGUFSource(spec)
    if os.path.isdir(spec) or spec.endswith((".safetensors", ".json")):
        return SafetensorsSource(spec, pattern)
    raise SourceError(f"unsupported source {spec}: expected a safetensors directory or file, "
                      "a .gguf file or a .k3pack file")


def open_remote(spec: str, pattern: str, cfg: Config | None = None) -> Source:
    """An HTTP(S) or S3 source; ``cfg`` supplies the tunables (None: ``Config``'s defaults,
    the one place they are written)."""
    cfg = cfg if cfg is not None else Config()
    kw = {"disk_cache": cfg.disk_cache, "disk_cache_size": cfg.disk_cache_size, "retries": cfg.http_retries}
    conns, timeout = cfg.http_conns, cfg.http_timeout
    if spec.startswith("s3://"):
        return S3Source(spec, pattern, conns=conns, timeout=timeout, **kw)
    return HttpSource(spec, pattern, conns=conns, timeout=timeout, **kw)
