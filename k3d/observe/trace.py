"""Route trace: one line per request, the exact access sequence for replaying policies.

Written by the daemon with ``--trace FILE`` (line-buffered, flushed per line, so a
killed daemon keeps every line it wrote); read back by ``parse`` for ``k3d replay``.
Fields are separated by single spaces::

    <µs> c=<client> t=<epoch> L<layer> n=<keys> miss=<m> evict=<e> wait=<w> pf=<p> pfu=<u> <id> <id> ...
    <µs> c=<client> t=<epoch> predict <layer>:<expert> <layer>:<expert> ...
    <µs> c=<client> t=<epoch> auto [<layer>:<expert> ...]
    <µs> c=<client> t=<epoch> done <layer> <layer> ...
    <µs> c=<client> t=<epoch> begin
    <µs> c=<client> bye

- A fetch line names the layer once (``L3``) and the experts as bare ids, in request
  order; a key of another layer than the first is written ``layer:expert``.
- ``c`` is the daemon's client id, ``t`` the client's epoch (token) when it sent the
  request.  A ``begin`` line is the client's ``begin_token`` (its pins of epoch ``t``
  go), ``bye`` its leaving or being dropped.  ``predict`` lines are predictions, from
  ``predict`` or from a fetch's ``predicted`` (written after the fetch, as they are
  applied).
- A ``done`` line is the client's release of those layers mid-token (protocol 6
  ``done``): its pins of their slots go then, not at its next ``begin``.  It is
  written where the daemon applied it: after that message's reported fetches.
- ``auto`` lines are the daemon's own predictions for the client (``--predict auto``),
  written after every fetch and its ``predict`` line, even when empty: they mark
  where the daemon's predictor ran, so ``k3d replay`` runs it at the same point.
- The counters on a fetch line are what the daemon counted for that fetch: misses,
  evictions, keys waited on, keys served by a prediction (``pf``), and the client's
  predictions found unused at its last ``begin_token`` (``pfu``, prefetched unused:
  the short names stay, as columns of a format the shipped traces are written in).
- Lines without ``c=``/``t=`` (the first trace format: no ``begin`` lines, ids
  comma-joined or space-separated) still parse: one client, and a new token begins
  where the layer does not increase.

``parse`` raises ``TraceError`` naming the line number of the first malformed line.

``RouteTrace`` is owned by the server thread (it writes a line as it plans each
request; a SIGHUP reload swaps the file there too); no lock.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

log = logging.getLogger("k3d")

FETCH, PREDICT, AUTO, BEGIN, BYE, DONE = "fetch", "predict", "auto", "begin", "bye", "done"
COUNTERS = ("miss", "evict", "wait", "pf", "pfu")


class TraceError(ValueError):
    pass


class RouteTrace:
    """The writer.  A failed write (full disk) logs once and stops tracing: a trace must
    never fail a request."""

    def __init__(self, path: str, t0: float):
        self.path = path
        self.t0 = t0
        self._f = open(path, "a", buffering=1, encoding="ascii")   # noqa: SIM115 (open while tracing)

    def _write(self, text: str) -> None:
        if self._f is None:
            return
        try:
            self._f.write(text)
        except OSError as e:
            log.error("route trace %s: %s; tracing stops", self.path, e)
            self._f = None

    def _head(self, now: float, client: int, epoch: int | None) -> str:
        us = int((now - self.t0) * 1e6)
        return f"{us} c={client}" if epoch is None else f"{us} c={client} t={epoch}"

    def fetch(self, now: float, client: int, epoch: int, keys: list[tuple[int, int]], miss: int, evict: int,
              wait: int, pf: int, pfu: int) -> None:
        layer = keys[0][0]
        ids = " ".join(str(e) if l == layer else f"{l}:{e}" for l, e in keys)
        self._write(f"{self._head(now, client, epoch)} L{layer} n={len(keys)} miss={miss} evict={evict} "
                      f"wait={wait} pf={pf} pfu={pfu} {ids}\n")

    def predict(self, now: float, client: int, epoch: int, keys: list[tuple[int, int]]) -> None:
        if keys:
            ids = " ".join(f"{l}:{e}" for l, e in keys)
            self._write(f"{self._head(now, client, epoch)} predict {ids}\n")

    def auto(self, now: float, client: int, epoch: int, keys: list[tuple[int, int]]) -> None:
        ids = "".join(f" {l}:{e}" for l, e in keys)
        self._write(f"{self._head(now, client, epoch)} auto{ids}\n")

    def done(self, now: float, client: int, epoch: int, layers) -> None:
        self._write(f"{self._head(now, client, epoch)} done {' '.join(map(str, sorted(layers)))}\n")

    def begin(self, now: float, client: int, epoch: int) -> None:
        self._write(f"{self._head(now, client, epoch)} begin\n")

    def bye(self, now: float, client: int) -> None:
        self._write(f"{self._head(now, client, None)} bye\n")

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


@dataclass(slots=True)
class Event:
    kind: str                          # FETCH, PREDICT, AUTO, BEGIN, BYE or DONE
    client: int
    keys: list = field(default_factory=list)
    counts: tuple | None = None        # a fetch's recorded (miss, evict, wait, pf, pfu), if any
    us: int = 0
    layers: tuple = ()                 # a DONE event's layers


def _key(tok: str, layer: int | None) -> tuple[int, int]:
    if ":" in tok:
        l, e = tok.split(":", 1)
        return int(l), int(e)
    if layer is None:
        raise ValueError(f"expert id {tok!r} without a layer (L<layer> field)")
    return layer, int(tok)


def parse_line(line: str):
    """(us, client | None, epoch | None, kind, keys, counters) of one line (a ``done``
    line's keys: its layers, as ints)."""
    toks = line.split()
    if not toks:
        return None
    us = int(toks[0])
    client = epoch = layer = None
    counts: dict[str, int] = {}
    kind, keys = FETCH, []
    for tok in toks[1:]:
        if tok.isdigit() and layer is not None:       # the common case: an expert id
            keys.append((layer, int(tok)))
        elif kind == DONE:
            if not tok.isdigit():
                raise ValueError(f"{tok!r} is not a layer number")
            keys.append(int(tok))
        elif tok.startswith("c="):
            client = int(tok[2:])
        elif tok.startswith("t="):
            epoch = int(tok[2:])
        elif tok in (PREDICT, AUTO, BEGIN, BYE, DONE):
            kind = tok
        elif tok[0] == "L":
            layer = int(tok[1:])
        elif "=" in tok:
            name, v = tok.split("=", 1)
            if name != "n" and name not in COUNTERS:
                raise ValueError(f"unknown field {name!r}")
            counts[name] = int(v)
        else:
            keys.extend(_key(t, layer) for t in tok.split(",") if t)
    if kind == FETCH and not keys:
        raise ValueError("a fetch line without expert ids")
    if kind == PREDICT and not keys:
        raise ValueError("a predict line without keys")
    if "n" in counts and kind == FETCH and counts["n"] != len(keys):
        raise ValueError(f"n={counts['n']} but {len(keys)} expert ids")
    if kind == DONE:
        if not keys:
            raise ValueError("a done line without layers")
        return us, client, epoch, kind, keys, None
    if any(l < 0 or e < 0 for l, e in keys):
        raise ValueError("negative layer or expert")
    recorded = tuple(counts.get(c, 0) for c in COUNTERS) if kind == FETCH and "miss" in counts else None
    return us, client, epoch, kind, keys, recorded


def parse(lines, name: str = "trace") -> list[Event]:
    """Events in request order.  Seed-format lines (no client) are client 0, whose
    token ends where the layer does not increase; a client whose epoch grows without
    a ``begin`` line gets one (traces merged by hand)."""
    events: list[Event] = []
    epoch: dict[int, int] = {}
    last_layer: dict[int, int] = {}
    for no, line in enumerate(lines, 1):
        try:
            parsed = parse_line(line)
        except (ValueError, IndexError) as e:
            raise TraceError(f"{name}:{no}: malformed trace line ({e}): {line.strip()[:120]!r}") from None
        if parsed is None:
            continue
        us, client, ep, kind, keys, recorded = parsed
        untagged = client is None          # the first format: one client, no begin lines
        client = 0 if untagged else client
        if kind == BEGIN:
            events.append(Event(BEGIN, client, us=us))
            epoch[client] = (ep if ep is not None else epoch.get(client, 0)) + 1
            last_layer.pop(client, None)
            continue
        if kind == BYE:
            events.append(Event(BYE, client, us=us))
            epoch.pop(client, None)
            last_layer.pop(client, None)
            continue
        if ep is not None:
            if client in epoch and ep > epoch[client]:
                events.append(Event(BEGIN, client, us=us))
            epoch[client] = ep
        elif kind == FETCH and untagged and client in last_layer and keys[0][0] <= last_layer[client]:
            events.append(Event(BEGIN, client, us=us))
        if kind == DONE:
            events.append(Event(DONE, client, us=us, layers=tuple(keys)))
            continue
        if kind == FETCH:
            last_layer[client] = keys[0][0]
        events.append(Event(kind, client, keys, recorded, us))
    return events


def read(path: str) -> list[Event]:
    try:
        with open(path, encoding="ascii", errors="strict") as f:
            return parse(f, path)
    except UnicodeDecodeError as e:
        raise TraceError(f"{path}: not a route trace (non-ASCII byte at offset {e.start})") from None
    except OSError as e:
        raise TraceError(f"cannot read trace {path}: {e.strerror}") from None
