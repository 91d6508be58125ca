"""The client's half of the hit path: fetches answered from the shared index, reported later.

``LocalHits`` holds the client's read-only ``IndexReader`` and the reports of
the fetches it answered itself, which go to the daemon, in order, with the
client's next message (``take``), so that the daemon's policy and counters hear
every access.

The window: a fetch is answered here only while ``now < t_req + lease / 2``,
``t_req`` being when the client sent the last request it waited for; closed
(``-inf``) from a fetch the daemon answered ``SlotsBusy`` (retried in vain) until
the next request: the daemon reuses slots meanwhile as if the client read nothing.  The daemon
keeps a slot this client may read from reuse until its next request or until
``lease`` after that reply (``k3d/cache/reuse.py``), so every view answered here
is good for at least ``lease / 2``, and until the next ``begin_token`` in a
client that makes a request per token.

Thread: the owning ``Client``'s thread.
"""

from __future__ import annotations

import select
import time

from . import errors
from .index import IndexReader, supported

REPORT_FLUSH = 1024      # reported keys held before they go without waiting for a next request
PIDFD_EVERY_S = 0.005    # how often a fetch answered here asks whether the daemon process exited


def hit_path_mode(choice, environ) -> tuple[str, str]:
    """(``"client"`` or ``"daemon"``, why daemon) from ``connect(hit_path=)``, else
    ``K3D_HIT_PATH``, else ``client`` where the CPU allows it."""
    raw = choice if choice is not None else environ.get("K3D_HIT_PATH", "client")
    if raw not in ("client", "daemon"):
        raise errors.K3Error(f"hit_path (K3D_HIT_PATH) must be 'client' or 'daemon', not {raw!r}")
    if raw == "daemon":
        return "daemon", "asked for"
    ok, why = supported()
    return ("client", "") if ok else ("daemon", why)


class LocalHits:
    def __init__(self, fd: int, size: int, lease_s: float, t_req: float, pidfd: int | None):
        """``t_req``: when the client sent the hello that attached it (its first request);
        ``pidfd``: the daemon process (None over tcp): a fetch is not answered here once
        it exited, so the client's next request notices the restart."""
        self.index = IndexReader(fd, size)
        self._exited = None
        self._checked = 0.0              # when the pidfd was last asked
        if pidfd is not None:
            self._exited = select.poll()
            self._exited.register(pidfd, select.POLLIN)
        self.window = lease_s / 2
        self.reports: list = []          # [layer, experts, slots], in the order they were answered
        self.reported = 0
        self.t_req = t_req
        self._full: dict[int, int] = {}  # layer -> retired count when all its experts were seen resident

    def answer(self, layer: int, experts: list[int]) -> list[int] | None:
        """The slots of ``experts`` if each is READY in the index (the fetch is recorded
        for the daemon), else None: the daemon answers."""
        now = time.monotonic()
        if not experts or now >= self.t_req + self.window or len(set(experts)) != len(experts):
            return None
        if self._exited is not None and now >= self._checked + PIDFD_EVERY_S:
            # A killed daemon's arena and index stay mapped and correct; asking the
            # kernel every few ms is enough to send the next fetch to its successor.
            if self._exited.poll(0):
                return None
            self._checked = now
        slots = self.index.ready_slots(layer, experts)
        if slots is not None:
            self.reports.append([layer, experts, slots])
            self.reported += len(experts)
        return slots

    def not_resident(self, keys: list[list[int]]) -> list[list[int]]:
        """``keys`` the index does not show resident (being read or READY): the ones worth
        predicting.  Keys it cannot tell about go to the daemon, which checks them."""
        out = []
        for layer in dict.fromkeys(l for l, _ in keys):
            es = [e for l, e in keys if l == layer]
            words = self.index.lookup(layer, es)
            out.extend([layer, e] for e, w in zip(es, words) if w <= 0)
        return out

    def layer_resident(self, layer: int, n: int) -> bool:
        """Whether the index shows experts 0..n-1 of ``layer`` all resident or being read: a
        hint for skipping work whose only use is predicting keys that are not (an entry may
        be cleared right after).  Once seen true it stays true while the index's retired
        count is unchanged (the daemon counts each entry after clearing it), so a steady
        state costs one load, not n lookups."""
        retired = self.index.retired()       # before the entries: a clear after this load changes it
        if self._full.get(layer) == retired:
            return True
        if all(w > 0 for w in self.index.lookup(layer, range(n))):
            self._full[layer] = retired
            return True
        return False

    def take(self) -> dict:
        """The reports as a message field (``{}`` when there are none), now handed over."""
        if not self.reports:
            return {}
        out, self.reports, self.reported = self.reports, [], 0
        return {"hits": out}

    def close(self) -> None:
        self.reports, self.reported = [], 0
        self.index.close()
