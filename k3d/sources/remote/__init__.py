"""Remote origins: a checkpoint behind HTTP(S) or S3, read with one ranged request per expert.

Modules, each importing only those below it::

    http.py, s3.py   transports: HttpSource, S3Source (RemoteSource subclasses)
    source.py        RemoteSource: catalog, fetch_into (retried), read -> tiers
    tiers.py         a load's parts: disk entry or origin, crc check, write-behind
    headers.py       header images parsed by the local parsers -> Catalog
    kept.py          the origin's answers at open, kept in the disk tier (offline restart)
    origin.py        whether the origin answers now (status; one attempt while down)
    retry.py         the one retry loop, the one 206 response check, fill_from
    disk_cache.py    the on-disk entry store (crash-safe, size-bounded LRU)

Thread: as every source: built on the main thread, read-only after, ``read``
on reader threads (see source.py for the shared, locked state).
"""
