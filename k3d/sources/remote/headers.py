"""Header images: a remote checkpoint's layout, read by the local parsers.

What a spec may name (URLs ending in ``/`` are directories)::

    DIR/                  DIR/model.safetensors.index.json + its shards, else DIR/model.safetensors
    .../x.json            a safetensors index;   .../x.safetensors   one file
    .../x.gguf            GGUF (stacked *_exps); .../x.k3pack        packed (crc32-verified)

Each file is stat'ed once through the origin (``add_file``: its size and
validator, the ETag, are pinned there), then its header bytes are fetched with
ranged GETs and written into a *header image*: a sparse local temporary file
of the remote file's size whose head holds those bytes (the data area is a
hole: it takes no disk and reads as zeros).  The local parsers
(``SafetensorsSource``, ``parse_gguf``/``GGUFSource``, ``PackedSource``)
validate the image exactly as they would the file and give the layout and
every expert's extents; they only read header bytes.  A safetensors
checkpoint's ``config.json`` (beside its index or file) is fetched whole into
the image directory, so the family rules see what they see locally.  Images live in one
temporary directory, deleted before ``open_catalog`` returns or raises.
Error messages name the URL, never an image.

How much is fetched: safetensors, the first ``HEAD_PROBE`` bytes and then the
rest of the JSON header its 8-byte length announces (at most the parser's
``MAX_HEADER``); packed, the same with its 16-byte prefix; GGUF, whose header
length is not written anywhere, ``GGUF_HEAD_START`` bytes, then four times as
much until the parser finds the data start inside what was fetched, at most
``MAX_HEADER_FETCH``.

Thread: runs once, on the main thread, while a ``RemoteSource`` is built.
Caller's obligation: ``origin`` (the source being built) provides
``add_file(url) -> file index``, ``fetch_bytes(file, start, length)``,
``get_small(url)`` (None: not found), ``join(base, name)`` and ``sizes``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import urllib.parse
from dataclasses import dataclass, field

from ..base import Extent, SourceError
from ..gguf import GGUFSource, parse_gguf
from ..packed import PackedSource
from ..packformat import MAX_HEADER as PACK_MAX_HEADER
from ..safetensors import CONFIG_NAME, MAX_HEADER as ST_MAX_HEADER, SafetensorsSource

INDEX_NAME = "model.safetensors.index.json"
HEAD_PROBE = 1 << 16          # first header fetch; more only if the header says so
GGUF_HEAD_START = 1 << 20
MAX_HEADER_FETCH = 256 << 20


@dataclass
class Catalog:
    """What the headers say: the checkpoint's format, slot layouts and every expert's extents."""
    format: str
    layout: list
    keys: dict[tuple[int, int], list[Extent]]
    tensor_format: str
    tensor_types: dict = field(default_factory=dict)
    expected_crc: dict[tuple[int, int], int] = field(default_factory=dict)   # packed: crc32 per expert
    layouts: dict = field(default_factory=dict)             # layer -> layout (see sources.base)
    layer_tensor_types: dict = field(default_factory=dict)
    family: object = None                                   # sources.families.Family
    family_fields: dict = field(default_factory=dict)       # GGUF / packs: describe()'s family fields

    def layout_of(self, layer: int) -> list:
        return self.layouts.get(layer, self.layout)


def _catalog(fmt: str, src, **kw) -> Catalog:
    """The catalog of a parsed (closed) header image: everything the local parser found."""
    return Catalog(fmt, src.layout, src.keys, src.tensor_format, dict(src.tensor_types), layouts=src.layouts,
                   layer_tensor_types=src.layer_tensor_types, family=src.family,
                   family_fields=dict(src.family_fields), **kw)


def open_catalog(origin, url: str, pattern: str) -> Catalog:
    """Stat ``url``'s files through ``origin``, fetch their headers, parse them; raises SourceError."""
    low = urllib.parse.urlsplit(url).path.lower()
    tmp = tempfile.mkdtemp(prefix="k3d-remote-hdr-")
    images = _Images(origin, tmp)
    try:
        if low.endswith("/") or low == "":
            base = url if url.endswith("/") else url + "/"
            index = origin.get_small(origin.join(base, INDEX_NAME))
            if index is not None:
                return _safetensors(images, origin.join(base, INDEX_NAME), index, pattern)
            try:
                return _safetensors(images, None, [origin.join(base, "model.safetensors")], pattern)
            except SourceError as e:
                if "not found" in str(e):
                    raise SourceError(f"{url}: neither {INDEX_NAME} nor model.safetensors there") from None
                raise
        if low.endswith(".json"):
            index = origin.get_small(url)
            if index is None:
                raise SourceError(f"{url}: not found")
            return _safetensors(images, url, index, pattern)
        if low.endswith(".safetensors"):
            return _safetensors(images, None, [url], pattern)
        if low.endswith(".gguf"):
            return _gguf(images, url)
        if low.endswith(".k3pack"):
            return _packed(images, url)
        raise SourceError(f"unsupported remote source {url}: expected a directory (ending in /), "
                          "a .json index, a .safetensors, .gguf or .k3pack file")
    except SourceError as e:
        msg = str(e)
        for image, remote in images.names.items():
            msg = msg.replace(image, remote)
        raise type(e)(msg.replace(tmp + "/", "")) from None     # OriginDown stays OriginDown
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class _Images:
    """Sparse local images of remote files' heads, and the URL each one stands for."""

    def __init__(self, origin, tmp: str):
        self.origin, self.tmp = origin, tmp
        self.names: dict[str, str] = {}     # image path -> URL (for error messages)

    def write(self, fi: int, url: str, prefix: bytes, name: str) -> str:
        path = os.path.join(self.tmp, name)
        with open(path, "wb") as f:
            f.write(prefix)
            f.truncate(self.origin.sizes[fi])     # sparse: the data area takes no disk
        self.names[path] = url
        return path

    def prefix(self, fi: int, length_at: int, max_header: int) -> bytes:
        """A header whose little-endian u64 length sits at ``[length_at-8, length_at)``:
        ``HEAD_PROBE`` bytes, then the rest of what that length announces."""
        size = self.origin.sizes[fi]
        head = self.origin.fetch_bytes(fi, 0, min(HEAD_PROBE, size))
        if len(head) >= length_at:
            n = int.from_bytes(head[length_at - 8:length_at], "little")
            if len(head) < length_at + n <= size and n <= max_header:
                head += self.origin.fetch_bytes(fi, len(head), length_at + n - len(head))
        return head


def _safetensors(images: _Images, index_url, index, pattern: str) -> Catalog:
    origin = images.origin
    if index_url is None:
        shard_urls = list(index)
        weight_map = None
    else:
        try:
            weight_map = json.loads(index)["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise SourceError(f"{index_url}: not a usable safetensors index ({e})") from None
        shard_urls = [origin.join(index_url, n) for n in names]
    paths = []
    for i, u in enumerate(shard_urls):
        fi = origin.add_file(u)
        paths.append(images.write(fi, u, images.prefix(fi, 8, ST_MAX_HEADER), f"{i:06d}.safetensors"))
    if weight_map is None:
        target = paths[0]
    else:
        local = {n: os.path.basename(paths[names.index(s)]) for n, s in weight_map.items()}
        target = os.path.join(images.tmp, INDEX_NAME)
        with open(target, "w") as f:
            json.dump({"weight_map": local}, f)
    # config.json beside the checkpoint names its family (the same rules as a local one)
    config = origin.get_small(origin.join(index_url or shard_urls[0], CONFIG_NAME))
    if config is not None:
        with open(os.path.join(images.tmp, CONFIG_NAME), "wb") as f:
            f.write(config)
        images.names[os.path.join(images.tmp, CONFIG_NAME)] = origin.join(index_url or shard_urls[0], CONFIG_NAME)
    st = SafetensorsSource(target, pattern)
    st.close()
    return _catalog("safetensors", st)


def _gguf(images: _Images, url: str) -> Catalog:
    origin = images.origin
    fi = origin.add_file(url)
    size = origin.sizes[fi]
    have = min(size, GGUF_HEAD_START)
    head = origin.fetch_bytes(fi, 0, have)
    while True:
        path = images.write(fi, url, head, "image.gguf")
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
        head += origin.fetch_bytes(fi, have, more - have)
        have = more
    g = GGUFSource(path)
    g.close()
    return _catalog("gguf", g)


def _packed(images: _Images, url: str) -> Catalog:
    fi = images.origin.add_file(url)
    head = images.prefix(fi, 16, PACK_MAX_HEADER)
    p = PackedSource(images.write(fi, url, head, "image.k3pack"), "buffered")
    p.close()
    crcs = {(int(k[0]), int(k[1])): int(c, 16) for k, c in zip(p.header["keys"], p.header["checksums"])}
    return _catalog("packed", p, expected_crc=crcs)
