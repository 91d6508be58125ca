"""The client's half of the hit path: fetches answered from the shared index, reported later.

``LocalHits`` holds the client's read-only ``IndexReader`` and the reports of
the fetches it answered itself, which go to the daemon, in order, with the
client's next message on its request socket (``take``), so that the daemon's
policy and counters hear every access, and so that the slots it read are pinned
(or claimed) for it before the daemon may reuse them (``k3d/cache/reuse.py``).

The window (the client's obligations C1-C3 there): a fetch is answered here only
while ``open``.  The client closes it before it sends a request
(``Attachment.post``) and opens it only when that request's reply has arrived
(``Client._call``, ``settle``, ``stream.py``); an exception on the way
(``Timeout``, ``KeyboardInterrupt``, an error reply, a re-attach) leaves it
closed until a later request succeeds.  While it is closed every view the
client holds was reported, so the daemon has pinned or claimed it; while it is
open the daemon reuses nothing retired after the count it had when it sent that
reply, until the client's next message.  Views therefore need no time bound:
one holds its bytes until the client's next ``begin_token()`` or ``close()``, or
its release of the view's layer.

Layer releases (``release``; C4 there): the layers go with the next message
(``take``, ``sync``: the ``done`` field), which the daemon applies after that
message's reports.  A fetch of a released layer answered here before the
release left cancels it (one the daemon answers carries it, applied first).
With a quota, a released layer's slots stop counting here when the message
carrying the release has left (``sent``; ``layer_slots``), not when it is queued
or taken: the daemon still counts them while it applies the reports that
message carries, or the next one's if its send fails.

A client that computes for long holds the daemon's reuse back; its lease thread
sends the reports and ``seen`` (``sync``) on the request socket, so that within a
heartbeat only the slots it read stay held.  With a pin quota (told at hello) the
client answers here no more distinct slots per token than the quota; after a
failed request in a token it answers none until the next token (a fetch it gave
up on may still pin slots it does not know of).

Threads: ``answer``, ``release``, ``take`` and ``new_token`` run on the owning ``Client``'s
thread; ``sync`` on its lease thread.  ``lock`` makes a lookup and the record of
its slots one step against ``sync``'s take-and-read: else a lookup made before
``sync`` read the count could be reported after it, and the daemon could reuse
its slot meanwhile.
"""

from __future__ import annotations

import select
import threading
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
    def __init__(self, fd: int, size: int, pidfd: int | None, quota: int = 0):
        """Made when the hello reply has arrived: the window opens with it.  ``pidfd``: the
        daemon process (None over tcp): a fetch is not answered here once it exited, so
        the client's next request notices the restart.  ``quota``: the pin quota told at
        hello (0: none)."""
        self.index = IndexReader(fd, size)
        self.lock = threading.Lock()
        self._exited = None
        self._checked = 0.0              # when the pidfd was last asked
        if pidfd is not None:
            self._exited = select.poll()
            self._exited.register(pidfd, select.POLLIN)
        self.reports: list = []          # [layer, experts, slots], in the order they were answered
        self.reported = 0
        self.inflight: list = []         # reports taken for a message not yet sent (``sent``/``unsend``)
        self.open = True                 # the window (module docstring)
        self.quota = quota
        self.token_slots: set[int] = set()    # with a quota: slots answered for this token
        self.layer_slots: dict[int, set] = {}    # with a quota: token_slots by the layer answered
        self._stuck = False              # with a quota: a request failed this token (``failed``)
        self.done: dict[int, None] = {}  # layers released (``release``), for the next message
        self._done_inflight: dict[int, set] = {}    # taken for a message not yet sent: layer -> its slots
        self.synced = 0                  # the retirement count last sent as ``seen``
        self._full: dict[int, int] = {}  # layer -> retired count when all its experts were seen resident

    def answer(self, layer: int, experts: list[int]) -> list[int] | None:
        """The slots of ``experts`` if each is READY in the index (the fetch is recorded
        for the daemon), else None: the daemon answers."""
        if not self.open or not experts or len(set(experts)) != len(experts):
            return None
        if self._exited is not None:
            now = time.monotonic()
            if now >= self._checked + PIDFD_EVERY_S:
                # A killed daemon's arena and index stay mapped and correct; asking the
                # kernel every few ms is enough to send the next fetch to its successor.
                if self._exited.poll(0):
                    return None
                self._checked = now
        with self.lock:
            slots = self.index.ready_slots(layer, experts)
            if slots is None:
                return None
            if self.quota:
                new = self.token_slots.union(slots)
                if len(new) > self.quota:
                    return None          # the daemon answers: within its quota, or QuotaExceeded
                self.token_slots = new
                self.layer_slots.setdefault(layer, set()).update(slots)
            if layer in self.done:
                # answered here before its release left: that release would end this view
                # too.  (One the daemon answers keeps it: it applies before the fetch's keys.)
                del self.done[layer]
            self.reports.append([layer, experts, slots])
            self.reported += len(experts)
        return slots

    def failed(self) -> None:
        """A request failed (its window stays shut; reports it did not send go back first
        in line); with a quota, this token's count is no longer known: answer nothing here
        until the next token."""
        self.open = False
        with self.lock:                  # releases not sent are dropped: pins kept are safe
            self.done, self._done_inflight = {}, {}
        self.unsend()
        if self.quota:
            self._stuck = True
            self.token_slots = set(range(self.quota + 1))

    def sent(self) -> None:
        """The message carrying the reports last taken left (they are the daemon's now).
        With a quota, the slots of the layers it released stop counting here now: a
        lookup made before (the lease thread's send: the client's thread answers
        meanwhile) may be reported behind the release if the send fails (``unsend``),
        and the daemon then counts them while it judges that report."""
        self.inflight = []
        if self._done_inflight:
            with self.lock:
                self._done_inflight = {}
                if self.quota and not self._stuck:
                    self.token_slots = set().union(*self.layer_slots.values())

    def unsend(self) -> None:
        """The message meant to carry the reports last taken did not leave (an interrupt,
        a closing socket): they go first in the next one, in their order."""
        if self.inflight or self._done_inflight:
            with self.lock:
                # A layer looked up since the take (the lease thread's: the client's thread
                # answers meanwhile) cancelled its release, as ``answer`` does one queued:
                # put back behind that lookup's report, the release would unpin its view.
                since = {r[0] for r in self.reports}
                self.reports[:0] = self.inflight
                self.reported += sum(len(r[1]) for r in self.inflight)
                self.inflight = []
                back, self._done_inflight = self._done_inflight, {}
                for layer, slots in back.items():
                    if layer not in since:
                        self.done[layer] = None
                    if slots:
                        self.layer_slots.setdefault(layer, set()).update(slots)
                        self.token_slots = self.token_slots.union(slots)

    def held_by_daemon(self, slots, layer: int) -> None:
        """With a quota: slots the daemon answered (and pinned) for ``layer`` count toward it
        here too."""
        if self.quota:
            self.token_slots = self.token_slots.union(slots)
            self.layer_slots.setdefault(layer, set()).update(slots)

    def release(self, layer: int) -> None:
        """The client is done with ``layer`` this token: the next message says so (``done``)."""
        with self.lock:
            self.done[layer] = None

    def _take_done(self) -> list[int]:
        """Under ``lock``: the released layers for the message being built (their slots
        count toward the quota until it has left: ``sent``)."""
        if not self.done:
            return []
        layers, self.done = list(self.done), {}
        for layer in layers:
            self._done_inflight[layer] = self.layer_slots.pop(layer, set())
        return layers

    def new_token(self) -> None:
        """The ``begin_token`` request left: the daemon's count starts again, so ours does
        (a release taken with it is moot: every pin of the token goes)."""
        self.token_slots = set()
        self.layer_slots = {}
        self._stuck = False
        with self.lock:
            self.done, self._done_inflight = {}, {}

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
        """The reports as a message field (``{}`` when there are none), now handed over.
        The caller sends them next on the request socket, before any other message."""
        with self.lock:
            out = self.inflight + self.reports    # an interrupted message's first, never dropped
            done = self._take_done()
            if not out:
                return {"done": done} if done else {}
            self.reports, self.reported = [], 0
            self.inflight = out
        return {"hits": out, "done": done} if done else {"hits": out}

    def sync(self) -> dict | None:
        """The lease thread's message fields: the reports so far (an interrupted message's
        first) and ``seen``, the retirement count read after taking them (under ``lock``:
        no lookup falls between the two).  Sent every heartbeat, even unchanged: a ``seen``
        the daemon could not apply (over its intake cap) must come again."""
        with self.lock:
            if self.index.closed_here:
                return None
            seen = self.index.retired()
            out = self.inflight + self.reports
            self.reports, self.reported = [], 0
            self.inflight = out
            done = self._take_done()
        self.synced = seen
        fields = {"hits": out, "seen": seen} if out else {"seen": seen}
        if done:
            fields["done"] = done
        return fields

    def close(self) -> None:
        with self.lock:
            self.reports, self.reported = [], 0
            self.open = False
            self.index.close()
