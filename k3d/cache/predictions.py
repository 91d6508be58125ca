"""The store's book of predictions: who predicted which slot, what came of it, the quota.

Part of ``Store`` (``k3d.cache.store``; a mixin over the store's own fields), kept
apart because it is one concern: a prediction is a slot assigned to a key before
anyone fetched it, pinned under ``(PREDICT, client)`` until that client's next
``end_epoch``, and then either used (a fetch took it: ``prefetch_hits``, counted
for its predictor) or found unused (demoted, ``prefetch_unused`` and the bytes it
read for nothing).  Per-client figures are ``PredictionStats`` in ``quality``;
figures of clients that left are summed in ``quality_gone``.

Invariants (``Store.check`` tests them): ``predicted_by`` (slot -> client) and
``predictions`` (client -> slots) are the same relation seen from both sides, and
every slot in them is resident and pinned under ``(PREDICT, client)``.

The pin quota (``live.pin_quota``) is read by the store alone: here (``quota_room``,
the prediction throttle) and in ``Store`` (fetch, report, repin).

Thread: the server thread, as the store.
"""

from __future__ import annotations

from k3d.observe.stats import PredictionStats

PREDICT = "predict"      # holder tag of a client's outstanding predictions


class PredictionBook:
    # -- epochs and clients -------------------------------------------------
    def end_epoch(self, client: int, holder) -> tuple[int, int]:
        """Release ``holder``'s pins; demote ``client``'s unused predictions.

        Returns (pins released, predictions found unused)."""
        released = len(self.policy.release(holder))
        unused = self.predictions.pop(client, None)
        if not unused and not self.policy.held((PREDICT, client)):
            return released, 0
        self.policy.release((PREDICT, client))
        unused = unused or set()
        for s in sorted(unused):
            del self.predicted_by[s]
            self.policy.demote(s)
        self._unused(client, unused)
        return released, len(unused)

    def _unused(self, client: int, slots) -> None:
        self.stats.prefetch_unused += len(slots)
        q = self.client_quality(client)
        q.prefetch_unused += len(slots)
        if self.key_bytes is not None:
            n = sum(self.key_bytes(self.slot_key[s]) for s in slots)
            q.unused_bytes += n
            self.stats.prefetch_unused_bytes += n

    def quota_room(self, client: int, started: int, wasteful: bool) -> int | None:
        """How many more predictions ``client`` may start this token under the pin quota
        (None: no quota).  ``wasteful`` (most of its predictions go unused) allows one
        per token beyond the ``started`` ones."""
        quota = self.live.pin_quota
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

    def _prediction_used(self, s: int) -> int:
        """A fetch took predicted slot ``s``: it counts for its predictor.  Returns 1."""
        by = self.predicted_by.pop(s)
        self.predictions[by].discard(s)
        self.client_quality(by).prefetch_hits += 1
        return 1

    def predict(self, client: int, keys: list[tuple[int, int]], now: float = 0.0) -> list[int]:
        """Assign slots to predicted keys not resident; stop at the first that has none.

        A background read never evicts a pinned slot (every client's current token),
        nor one the policy expects to be reused sooner than the prediction
        (``policy.admits`` with the client's measured precision as the confidence):
        ``prefetch_refused`` counts those.  Each prediction is pinned under
        ``(PREDICT, client)`` until the client's next ``end_epoch``."""
        started = []
        q = self.client_quality(client)
        for key in keys:
            if key in self.key_slot:
                continue
            victim = None
            if not self.free:
                if not self.reuse.could_reuse_now():
                    break                       # make_room frees slots ahead for the next ones
                victim = self._victim()
                if victim is None:
                    break
                if not self.policy.admits(key, victim, q.confidence()):
                    self.stats.prefetch_refused += 1
                    q.refused += 1
                    break
            s, evicted = self._assign(key, urgent=False, victim=victim, now=now)
            self.stats.evictions += evicted
            self.predicted_by[s] = client
            self.predictions.setdefault(client, set()).add(s)
            self.policy.pin(s, (PREDICT, client))
            started.append(s)
        self.stats.prefetched += len(started)
        q.prefetched += len(started)
        return started
