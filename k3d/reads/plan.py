"""Extent planning: how one batch of experts' reads is cut into parts for the readers.

Pure functions of integers and ``Extent``s, called on the server thread when a
load starts (and by the benches' floors, so they cut batches as the server does).
"""

from __future__ import annotations

from ..sources.base import PAGE, Extent

COLD_READERS = 8      # a cold disk or an origin wants many requests in flight


def readers_for(kind: str, cpus: int | None) -> int:
    """Reader threads when ``--readers`` is not given, per read path.

    - ``safetensors`` / ``gguf`` (buffered reads, the page cache usually warm): a
      warm miss is a memory copy, CPU-bound, and more threads than 2 per core only
      contend, so 2 per CPU, 2 to 8.
    - ``packed`` (O_DIRECT, or buffered and dropped after reading: always cold),
      ``http`` / ``s3`` / remote: latency-bound, so COLD_READERS requests in flight.
    bench/README.md ("reader threads") has the measurements behind both.
    """
    if kind in ("safetensors", "gguf"):
        return max(2, min(COLD_READERS, 2 * (cpus or 1)))
    return COLD_READERS


def parts_per_key(readers: int, keys: int, max_parts: int) -> int:
    """Parts to cut each of ``keys`` experts read together into, so that ``readers``
    threads all have work (whole parts per reader: never more parts than readers)."""
    return max(1, min(max_parts, readers // keys))


def split_extents(extents: list[Extent], parts: int) -> list[list[Extent]]:
    """Cut extents into at most ``parts`` groups of about equal bytes (page-aligned cuts)."""
    total = sum(e.length for e in extents)
    if parts <= 1 or total <= PAGE:
        return [list(extents)]
    share = max(PAGE, (-(-total // parts) + PAGE - 1) // PAGE * PAGE)     # parts * share >= total
    out, cur, room = [], [], share
    for e in sorted(extents, key=lambda x: (x.file, x.offset)):
        off, so, left = e.offset, e.slot_offset, e.length
        while left:
            take = min(left, room)
            cur.append(Extent(e.file, off, so, take))
            off, so, left, room = off + take, so + take, left - take, room - take
            if room == 0:
                out.append(cur)
                cur, room = [], share
    if cur:
        out.append(cur)
    return out
