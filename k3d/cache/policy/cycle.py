"""The MoE-aware policy (``--policy cycle``, the default): the requests it hears, and
admission of background reads.  Pure: see ``base``.

MoE layers run in a fixed cycle 0..L-1 per token, so where an expert's layer lies in
the cycle bounds its next use: an expert of a layer the current token has passed
is not needed before the next token, one of the next layer may be needed at the
very next step.  Plain LRU gets this backwards: its least recently used experts
are the next token's first layers.

Victim order (largest first, ties: lower slot): ``score(key) = (passed(layer),
d(layer) / p(key))``, passed layers before any layer ahead, then the layer steps per
expected hit the slot would buy; ``order.CycleOrder`` states it and keeps it.

Two parts, composed: ``self.usage`` (``usage.UsageStats``) knows keys and layers,
never slots; this class knows the residents (``_key``, ``_by_layer``), the pins
(``PinTable``) and the index (``filing``, ``order``), and asks ``usage`` for rates and
orders.  Visits are counted per layer (``visit``, once per fetch per layer), and the
layer being served is the last one visited (``_current``; ``_first`` starts the
pass), so several clients count as chances for a key and share one notion of "now".

Background reads (``admits``): a prediction may evict a slot only if the slot's
score is larger than the prediction's own (its layer's distance, the predicting
client's measured precision as ``p``).
"""

from __future__ import annotations

from k3d.cache.policy.order import CycleOrder
from k3d.cache.policy.usage import UsageStats


class CyclePolicy(CycleOrder):
    name = "cycle"

    def __init__(self, layers: int = 0, half_life: float = 8.0, prior_weight: float = 1.0) -> None:
        super().__init__(UsageStats(half_life, prior_weight), layers)

    # -- requests -------------------------------------------------------------
    def visit(self, layer: int) -> None:
        """A fetch for ``layer`` begins: one more chance for each of its experts."""
        self.usage.visit(layer)
        if layer <= self._current or self._first < 0:
            self._first = layer                       # the cycle wrapped: a new token
        self._current = layer
        if layer >= self.layers:
            self.layers = layer + 1
        self._cand.pop(layer, None)
        self._dirty.add(layer)

    def touch_all(self, slots, keys) -> None:
        """``touch`` of each key in order (a fetch's hits)."""
        self._used_all(keys, slots)

    def hear_all(self, fetches) -> None:
        """``PinTable.hear_all`` without the touches' indirection (every reported hit runs
        it); a report's keys are all of its layer, which ``visit`` has just marked."""
        visit, used = self.visit, self._used_layer
        for layer, keys, slots in fetches:
            visit(layer)
            used(layer, keys, slots)

    def _used_all(self, keys, slots) -> None:
        """``_used_layer`` per run of keys of one layer, in order (a fetch's keys come so)."""
        cand, dirty = self._cand, self._dirty
        i, n = 0, len(keys)
        while i < n:
            layer, j = keys[i][0], i + 1
            while j < n and keys[j][0] == layer:
                j += 1
            cand.pop(layer, None)
            dirty.add(layer)
            self._used_layer(layer, keys[i:j], slots[i:j])
            i = j

    def _used_layer(self, layer: int, keys, slots) -> None:
        """Each of ``keys``, all of ``layer`` (resident in ``slots``), was used, in order:
        ``usage`` counts it, and an unpinned slot's order is refiled by ``_flush_moves``.
        The caller has marked the layer's candidate stale (``visit`` does).  A used key
        is usually pinned already (a fetch pins before it touches), so its layer's least
        unpinned value rarely moves."""
        self.usage.used(layer, keys)
        free = self._free.get(layer)
        if free:
            moves = self._moves
            for slot in slots:
                if slot in free:
                    moves.add(slot)

    def insert(self, slot: int, key=None, predicted: bool = False) -> None:
        self._enter(slot, key, predicted)
        if slot not in self._holders:    # pending at the next victim, unless pinned first (a miss is)
            self._fresh.add(slot)

    def insert_pinned(self, slot: int, key, predicted: bool, holder) -> None:
        """``insert`` then ``pin`` in one step (a miss or a prediction): pinned before
        any victim is chosen, so never ``_fresh``; ``slot`` holds no pin (it was free,
        or ``replace`` removed it)."""
        self._enter(slot, key, predicted)
        held = self._pins.get(holder)                 # ``PinTable.pin``, its first pin
        if held is None:
            self._pins[holder] = {slot}
        else:
            held.add(slot)
        self._holders[slot] = {holder}

    def _enter(self, slot: int, key, predicted: bool) -> None:
        """``key`` is resident in ``slot`` now, requested (a use) or ``predicted`` (not one)."""
        layer = key[0]
        self._key[slot] = key
        mine = self._by_layer.get(layer)
        if mine is None:
            self._by_layer[layer] = {slot}
        else:
            mine.add(slot)
        if layer >= self.layers:
            self.layers = layer + 1
        if not predicted:                             # a guess is not a use
            # ``_used_all`` of one key, whose slot was just inserted (so not filed: no move)
            self._cand.pop(layer, None)
            self._dirty.add(layer)
            self.usage.used(layer, (key,))

    def replace(self, slot: int, key, predicted: bool, holder) -> None:
        """``remove`` then ``insert_pinned``: ``slot`` is a victim, taken by ``key`` at once."""
        self.remove(slot)
        self.insert_pinned(slot, key, predicted, holder)

    def touch(self, slot: int, key=None) -> None:
        self._used_all((self._key[slot] if key is None else key,), (slot,))

    def demote(self, slot: int) -> None:
        """An unused prediction: nothing to undo (a guess never counted as a use)."""

    def remove(self, slot: int) -> None:
        key = self._key.get(slot)
        if key is not None:
            self._pinned_all((slot,))                 # (before the key goes: it names the layer)
            self._by_layer[key[0]].discard(slot)
            del self._key[slot]
        self._forget_pins(slot)

    def has(self, slot: int) -> bool:
        return slot in self._key

    # -- choosing (``order.CycleOrder``: victim, victims, score) ----------------
    def evictable(self, exclude=()) -> int:
        return self._unpinned_among(self._key, exclude)

    def admits(self, key, slot: int, confidence: float) -> bool:
        victim = self._key[slot]
        vl, kl = victim[0], key[0]
        # ``score(victim) > score(key, confidence)`` with ``passed`` and ``distance`` inline
        # (every prediction that needs a victim asks)
        c, f = self._current, self._first
        if f <= c:
            vp, kp = f <= vl <= c, f <= kl <= c
        else:
            vp, kp = vl >= f or vl <= c, kl >= f or kl <= c
        if vp != kp:
            return vp
        cand = self._cand.get(vl)
        # ``slot`` is usually the victim just chosen: its layer's candidate, whose rate
        # ``victim`` has cached as ``score`` computes it (nothing changed since)
        p = cand[1] if cand is not None and cand[0] == slot else self.usage.rate(victim)
        L = max(self.layers, 1)
        return ((vl - c - 1) % L + 1) / max(p, 1e-9) > ((kl - c - 1) % L + 1) / max(confidence, 1e-9)

    # -- warm restart and audit -------------------------------------------------
    def ranking(self, slot_key=None) -> list[tuple]:
        """Every key seen, most likely to be picked first (``usage.ranking``)."""
        return self.usage.ranking()

    def export(self) -> dict:
        return self.usage.export()

    def restore(self, state: dict) -> None:
        """Take saved statistics (ValueError, nothing changed, if malformed) and file the
        residents afresh by them: every cached order, least and score may have moved."""
        self.layers = max(self.layers, self.usage.restore(state))
        self._pending.clear()
        self._fresh.clear()
        self._moves.clear()
        self._free = self._refiled()
        self._best.clear()
        self._heaps.clear()
        self._cand.clear()
        self._stamp = None

    def check(self) -> None:
        """Audit: the pins, ``usage``, and the filing against one built from scratch."""
        self.check_pins()
        self.check_filing()
        self._stamp = None                            # (the audit recomputed candidates: score afresh)
        assert set(self._holders) <= set(self._key), "a pin on a slot the policy does not hold"
        self.usage.check()
