"""The book of predictions: who predicted which slot, what came of it, per client.

A prediction is a slot the store assigned to a key before anyone fetched it,
pinned under ``(PREDICT, client)`` until that client's next ``end_epoch``, and
then either used (a fetch took it: ``prefetch_hits``, counted for its predictor)
or found unused (demoted, ``prefetch_unused`` and the bytes it read for nothing).
Per-client figures are ``PredictionStats`` in ``quality``; figures of clients that
left are summed in ``quality_gone``.

``PredictionBook`` owns ``predicted_by``, ``predictions``, ``quality`` and
``quality_gone`` and nothing else: it never sees a slot's state, the policy or the
store's counters.  The store (``k3d.cache.store``) tells it what happens to a
predicted slot, in the order it happens, and does the rest itself (pins, demotion,
``Counters``):

- ``add``: the store started a read for a prediction and pinned the slot;
- ``used``: a fetch (or a reported hit) took a predicted slot;
- ``drop``: a predicted slot left the cache (evicted: the store counts it unused;
  a failed read: not counted);
- ``end_epoch``: the client's token is over: its predictions still unused go,
  sorted by slot (the order the store demotes them in), and ``unused`` counts them.

Invariants (``check``; ``Store.check`` adds that every slot here is resident and
pinned under ``(PREDICT, client)``): ``predicted_by`` (slot -> client) and
``predictions`` (client -> slots) are the same relation seen from both sides.

A client's entry in ``quality`` is made by its first ``client_quality``, ``used``
or ``unused``, so the order of clients there (status lists them so) is the order
of the store's calls.

The pin quota (``live.pin_quota``) is read by the store alone and passed in here
(``quota_room``, the prediction throttle).

Thread: the server thread, as the store.
"""

from __future__ import annotations

from k3d.observe.stats import PredictionStats

PREDICT = "predict"      # holder tag of a client's outstanding predictions


class PredictionBook:
    def __init__(self) -> None:
        self.predicted_by: dict[int, int] = {}            # slot -> predicting client
        self.predictions: dict[int, set[int]] = {}        # client -> slots it predicted
        self.quality: dict[int, PredictionStats] = {}     # client -> its predictions and timeliness
        self.quality_gone = PredictionStats()             # summed over clients that left

    # -- what happens to a predicted slot -----------------------------------
    def add(self, client: int, s: int) -> None:
        """``client`` predicted slot ``s`` (its read started, the store pinned it)."""
        self.predicted_by[s] = client
        self.predictions.setdefault(client, set()).add(s)

    def used(self, s: int) -> int:
        """A fetch took predicted slot ``s``: it counts for its predictor.  Returns 1."""
        by = self.predicted_by.pop(s)
        self.predictions[by].discard(s)
        self.client_quality(by).prefetch_hits += 1
        return 1

    def drop(self, s: int) -> int | None:
        """Slot ``s`` left the cache: forget its prediction.  Returns the client that
        predicted it (None: it was no prediction)."""
        by = self.predicted_by.pop(s, None)
        if by is not None:
            self.predictions[by].discard(s)
        return by

    def end_epoch(self, client: int) -> list[int] | None:
        """``client``'s token is over: its unused predictions leave the book, sorted
        by slot.  None: it had none recorded (not even an empty set)."""
        unused = self.predictions.pop(client, None)
        if unused is None:
            return None
        for s in unused:
            del self.predicted_by[s]
        return sorted(unused)

    def unused(self, client: int, n: int, nbytes: int) -> None:
        """``n`` of ``client``'s predictions, ``nbytes`` read, were never used."""
        q = self.client_quality(client)
        q.prefetch_unused += n
        q.unused_bytes += nbytes

    # -- the quota and per-client figures ---------------------------------------
    def quota_room(self, client: int, started: int, wasteful: bool, quota: int) -> int | None:
        """How many more predictions ``client`` may start this token under the pin
        ``quota`` (0: none; returns None).  ``wasteful`` (most of its predictions go
        unused) allows one per token beyond the ``started`` ones."""
        if not quota:
            return None
        room = quota - len(self.predictions.get(client, ()))
        return min(room, 1 - started) if wasteful else room

    def client_quality(self, client: int) -> PredictionStats:
        q = self.quality.get(client)
        if q is None:
            q = self.quality[client] = PredictionStats()
        return q

    def forget_client(self, client: int) -> None:
        """The client left (after its ``end_epoch``): fold its figures into ``quality_gone``."""
        q = self.quality.pop(client, None)
        if q is not None:
            g = self.quality_gone
            for name in vars(q):
                setattr(g, name, getattr(g, name) + getattr(q, name))

    def check(self) -> None:
        """Assert that ``predicted_by`` and ``predictions`` are one relation."""
        pairs = {(s, c) for c, slots in self.predictions.items() for s in slots}
        assert pairs == {(s, c) for s, c in self.predicted_by.items()}, "the two maps of predictions differ"
