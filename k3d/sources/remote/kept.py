"""Kept headers: what a remote source learned from its origin at start, kept in the disk tier.

Opening a remote source asks the origin three kinds of question: each file's
size and validator (``stat``), small whole files (the safetensors index:
``small``) and header byte ranges (``ranges``).  With ``--disk-cache`` the
answers of a successful open are recorded and kept as one file in the disk
tier's directory, ``DIR/headers/<sha256 of the source URL>.json``::

    {"version": 1, "url": SOURCE URL,
     "stat":   {FILE URL: [size, validator], ...},
     "small":  {URL: base64 bytes | null, ...},
     "ranges": {FILE URL: [[start, base64 bytes], ...], ...}}

written as a temporary file, fsynced and renamed (a crash leaves the old one
or the new one, never half of one).  When the origin does not answer at the
next start (``OriginDown``), the source is opened again from the kept answers
alone (``replay``): the same parsers validate the same header bytes, so the
daemon has the same layout, extents and validators as when the origin was
up, and serves what the disk tier holds.  Every later origin request still
carries the kept validator (``If-Match``), so an origin that comes back with
a changed file answers 412 for it: an error naming the file, never a byte of
the other version.

Thread-safety: a ``Recorder`` and a ``Replay`` are used by the opening thread
only (sources open before the readers start).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os

from .retry import OriginDown

VERSION = 1


def kept_path(cache_dir: str, url: str) -> str:
    return os.path.join(cache_dir, "headers", hashlib.sha256(url.encode()).hexdigest()[:32] + ".json")


def _b64(data: bytes | None):
    return None if data is None else base64.b64encode(data).decode()


class Recorder:
    """The origin's answers while a source opens (``keep_*``), saved to the disk tier."""

    def __init__(self, url: str):
        self.url = url
        self.stat_answers: dict[str, list] = {}
        self.small_answers: dict[str, str | None] = {}
        self.range_answers: dict[str, list] = {}

    def keep_stat(self, url: str, size: int, validator: dict) -> None:
        self.stat_answers[url] = [size, validator]

    def keep_small(self, url: str, data: bytes | None) -> None:
        self.small_answers[url] = _b64(data)

    def keep_range(self, url: str, start: int, data: bytes) -> None:
        self.range_answers.setdefault(url, []).append([start, _b64(data)])

    def save(self, cache_dir: str) -> str:
        path = kept_path(cache_dir, self.url)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        doc = {"version": VERSION, "url": self.url, "stat": self.stat_answers, "small": self.small_answers,
               "ranges": self.range_answers}
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dfd = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        return path


class Replay:
    """The kept answers, standing in for the origin while it is down."""

    def __init__(self, doc: dict, path: str):
        self.path = path
        self._stat = doc["stat"]
        self._small = doc["small"]
        self._ranges = doc["ranges"]

    @classmethod
    def load(cls, cache_dir: str, url: str) -> Replay | None:
        """The kept headers of ``url``, or None if there are none (or they are unreadable)."""
        path = kept_path(cache_dir, url)
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            return None
        if not isinstance(doc, dict) or doc.get("version") != VERSION or doc.get("url") != url:
            return None
        return cls(doc, path)

    def _missing(self, what: str) -> OriginDown:
        return OriginDown(f"{what} is not among the headers kept in {self.path} (the origin is down)")

    def stat(self, url):
        if url not in self._stat:
            raise self._missing(f"the size of {url}")
        size, validator = self._stat[url]
        return size, validator

    def small(self, url):
        if url not in self._small:
            raise self._missing(url)
        data = self._small[url]
        return None if data is None else base64.b64decode(data)

    def ranges(self, files: list[str]):
        def fetch(fi, start, length):
            for got_start, data in self._ranges.get(files[fi], ()):
                raw = base64.b64decode(data)
                if got_start <= start and start + length <= got_start + len(raw):
                    return raw[start - got_start:start - got_start + length]
            raise self._missing(f"bytes {start}-{start + length - 1} of {files[fi]}")
        return fetch
