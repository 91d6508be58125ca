"""The MoE-aware policy (``--policy cycle``, the default): residents, pins and the
victim index.  Pure: see ``base``.

MoE layers run in a fixed cycle 0..L-1 per token, so where an expert's layer lies in
the cycle bounds its next use: an expert of a layer the current token has passed
is not needed before the next token, one of the next layer may be needed at the
very next step.  Plain LRU gets this backwards: its least recently used experts
are the next token's first layers.

Victim order (largest first, ties: lower slot)::

    score(key) = (passed(layer), d(layer) / p(key))

- ``passed``: the key's layer is one the current token has already served (its
  layer is at or before the one being served), so it cannot be used before the
  token ends: such keys go before any key of a layer still ahead.
- ``d``: layer steps until the key's layer is served again (1 = the next layer,
  L = the one being served now).
- ``p``: the chance the key is picked when its layer comes: a decayed count of its
  uses (``half_life`` visits of its layer), shrunk towards the layer's mean rate, as
  ``self.usage`` (``usage.UsageStats``) keeps it.  ``d / p`` is the layer steps per
  expected hit the slot would buy.

Two parts, composed: ``self.usage`` knows keys and layers, never slots; this class
knows the residents (``_key``, ``_by_layer``), the pins (``PinTable``) and the
index below, and asks ``usage`` for rates and orders.  Visits are counted per layer
(``visit``, once per fetch per layer), and the layer being served is the last one
visited (``_current``; ``_first`` starts the pass), so several clients count as
chances for a key and share one notion of "now".

Index (so a victim costs O(L), not O(slots)): within a layer ``d`` is shared, so the
layer's candidate is its unpinned resident with the least ``usage.order`` (its
decayed count, comparable within a layer and changing only when the key is used).
Each layer keeps its unpinned residents with that value (``_free``) and their least
(``_best``), updated as they change: a change to any other slot moves the least
only if the new value is below it, so the layer's least is found again only when
it is itself pinned, evicted or used, from a heap of the layer's filed values
(``_heaps``; entries that no longer match ``_free`` are dropped as they surface):
O(log n) in its layer, not a scan of its residents.  A slot that may become a victim
(its last pin gone, or inserted unpinned and still so at the next victim: ``_fresh``;
nearly every inserted slot is pinned at once) waits unfiled in its layer's ``_pending`` until
that layer's candidate is next asked for (``_candidate``): a fetch's miss, pinned right
away, is never filed, and neither is a slot a token's end unpins and the next token
pins again before its layer is scored (most of them: a token's end releases every
pin its client held, and ~80 % of them are the next token's hits).  Filing later
gives the same ``_free``: a key's order changes only when it is used, and filing
reads it then.  An unpinned resident used waits in ``_moves`` (a use only raises its order, so a batch of them
has one outcome in any order).  The candidate's rate changes with every visit and
use of its layer, so it is cached apart (``_cand``), until then; ``victim`` keeps
each layer's score while the cycle's position stays (``_stamp``), rescoring the
layers in ``_dirty``.  ``check`` recomputes all of it from scratch and compares:
it yields the victims of a full scan.

Background reads (``admits``): a prediction may evict a slot only if the slot's
score is larger than the prediction's own (its layer's distance, the predicting
client's measured precision as ``p``).
"""

from __future__ import annotations

from heapq import heapify, heappop, heappush

from k3d.cache.policy.base import PinTable
from k3d.cache.policy.usage import UsageStats

_STALE = object()                                 # a cache entry to compute again


class CyclePolicy(PinTable):
    name = "cycle"

    def __init__(self, layers: int = 0, half_life: float = 8.0, prior_weight: float = 1.0):
        super().__init__()
        self.layers = layers                          # L; grows with the keys seen
        self.usage = UsageStats(half_life, prior_weight)
        self._key: dict[int, tuple] = {}              # resident slot -> key
        self._by_layer: dict[int, set[int]] = {}      # layer -> resident slots
        self._free: dict[int, dict[int, float]] = {}  # layer -> {unpinned resident slot: its usage.order}
        self._best: dict[int, tuple | None] = {}      # layer -> least (order, slot) of _free (absent: stale)
        self._heaps: dict[int, list] = {}             # layer -> heap of (order, slot) filed in _free (lazy)
        self._cand: dict[int, tuple | None] = {}      # layer -> (slot, rate) of _best's slot (absent: stale)
        self._pscores: dict[int, tuple] = {}          # passed layer -> its candidate's victim order
        self._nscores: dict[int, tuple] = {}          # the same for layers ahead, when _ahead
        self._ahead = False
        self._dirty: set[int] = set()                 # layers whose _cand went since ``victim`` scored them
        self._stamp = None                            # (current, first, layers) the scores are for
        self._pending: dict[int, set[int]] = {}       # layer -> unpinned residents not yet in _free
        self._fresh: set[int] = set()                 # inserted unpinned, not yet pending (most get pinned)
        self._moves: set[int] = set()                 # unpinned residents used, not yet refiled
        self._current = -1                            # the layer being served (last visited)
        self._first = -1                              # the first layer of the current pass

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
        layer = key[0]
        self._key[slot] = key
        self._by_layer.setdefault(layer, set()).add(slot)
        if layer >= self.layers:
            self.layers = layer + 1
        if slot not in self._holders:    # pending at the next victim, unless pinned first (a miss is)
            self._fresh.add(slot)
        if not predicted:                             # a guess is not a use
            self._used_all((key,), (slot,))

    def touch(self, slot: int, key=None) -> None:
        self._used_all((self._key[slot] if key is None else key,), (slot,))

    def _flush_moves(self) -> None:
        """File the new order of the unpinned residents used since the last victim.
        Deferred because a use only raises a key's order, so a batch of them has one
        outcome in any order: each slot's last value, and the layer's least kept unless
        the least itself was used (then scanned again); a hit then costs no log."""
        moves, self._moves = self._moves, set()
        key_of, order, frees = self._key, self.usage.order, self._free
        for s in moves:
            key = key_of.get(s)
            if key is None or s not in frees.get(key[0], ()):
                continue                              # evicted or pinned since
            self._moved(key[0], s, order(key))

    def _moved(self, layer: int, slot: int, f: float) -> None:
        """Unpinned resident ``slot``'s order is ``f`` now (a use while unpinned)."""
        self._free[layer][slot] = f
        h = self._heaps.get(layer)
        if h is not None:
            heappush(h, (f, slot))
        b = self._best.get(layer, _STALE)
        if b is not _STALE and b is not None:
            if b[1] == slot:
                del self._best[layer]                 # the least itself moved: scan again
                self._cand.pop(layer, None)
                self._dirty.add(layer)
            elif (f, slot) < b:
                self._best[layer] = (f, slot)

    def demote(self, slot: int) -> None:
        """An unused prediction: nothing to undo (a guess never counted as a use)."""

    def remove(self, slot: int) -> None:
        key = self._key.get(slot)
        if key is not None:
            layer = key[0]
            self._pinned_all((slot,))                 # (before the key goes: it names the layer)
            self._by_layer[layer].discard(slot)
            del self._key[slot]
        self._forget_pins(slot)

    def has(self, slot: int) -> bool:
        return slot in self._key

    def _pinned(self, slot: int) -> None:
        self._pinned_all((slot,))

    def _pinned_all(self, slots) -> None:
        """``slots`` may not be victims any more (pinned, or gone: ``remove``).  Inline:
        a fetch pins every key it names and a token's end releases them all."""
        key_of, frees, bests, pending, fresh = self._key, self._free, self._best, self._pending, self._fresh
        for s in slots:
            key = key_of.get(s)
            if key is None:
                continue
            if s in fresh:
                fresh.discard(s)
                continue
            layer = key[0]
            waiting = pending.get(layer)
            if waiting and s in waiting:
                waiting.discard(s)                    # (never filed: nothing else to undo)
                continue
            free = frees.get(layer)
            if free is not None and free.pop(s, None) is not None:
                b = bests.get(layer)
                if b is not None and b[1] == s:       # the least went: scan again
                    del bests[layer]
                    self._cand.pop(layer, None)
                    self._dirty.add(layer)

    def _unpinned_all(self, slots) -> None:
        """``slots`` may be victims now (their last pin went, or inserted unpinned): each
        waits in its layer's ``_pending``, whose candidate is stale from now on."""
        key_of, pending, cand, dirty = self._key, self._pending, self._cand, self._dirty
        for s in slots:
            key = key_of.get(s)
            if key is None:
                continue
            layer = key[0]
            waiting = pending.get(layer)
            if waiting is None:
                pending[layer] = {s}
                cand.pop(layer, None)
                dirty.add(layer)
            elif not waiting:
                waiting.add(s)
                cand.pop(layer, None)
                dirty.add(layer)
            else:
                waiting.add(s)

    def _file_pending(self) -> None:
        """File every layer's pending slots (restore and audit want ``_free`` whole)."""
        pending, self._pending = self._pending, {}
        for layer, slots in pending.items():
            if slots:
                self._file(layer, slots)

    def _file(self, layer: int, slots) -> None:
        """File ``slots`` (unpinned residents of ``layer``) in ``_free`` by their order now."""
        key_of, order, bests, heaps = self._key, self.usage.order, self._best, self._heaps
        free = self._free.get(layer)
        if free is None:
            free = self._free[layer] = {}
        h = heaps.get(layer)
        for s in slots:
            f = order(key_of[s])                      # (used while pinned: computed now)
            free[s] = f
            if h is not None:
                heappush(h, (f, s))
            b = bests.get(layer, _STALE)
            if b is None or (b is not _STALE and (f, s) < b):
                bests[layer] = (f, s)

    # -- scoring --------------------------------------------------------------
    def distance(self, layer: int) -> int:
        """Layer steps until ``layer`` is served again (1 = next, L = the current one)."""
        return (layer - self._current - 1) % max(self.layers, 1) + 1

    def passed(self, layer: int) -> bool:
        """``layer`` was served in the current pass of the cycle (or is being served)."""
        c, f = self._current, self._first
        return f <= layer <= c if f <= c else (layer >= f or layer <= c)

    def score(self, key, p: float | None = None) -> tuple[bool, float]:
        """Victim order, largest first: (passed, layer steps per expected hit)."""
        p = self.usage.rate(key) if p is None else p
        return self.passed(key[0]), self.distance(key[0]) / max(p, 1e-9)

    def _candidate(self, layer: int):
        """(slot, rate) of the layer's best victim, or None; cached until the layer changes."""
        if self._fresh:
            self._unpinned_all(self._fresh)
            self._fresh = set()
        waiting = self._pending.get(layer)
        if waiting:
            self._pending[layer] = set()
            self._file(layer, waiting)
        if self._moves:
            self._flush_moves()
        cand = self._cand.get(layer, _STALE)      # (victim asks only when it is not cached:
        if cand is not _STALE:                    # no KeyError raised and caught each time)
            return cand
        b = self._best.get(layer, _STALE)
        if b is _STALE:                  # least (order, slot): ties go to the lower slot
            b = self._best[layer] = self._least(layer)
        cand = None if b is None else (b[1], max(self.usage.rate(self._key[b[1]]), 1e-9))
        self._cand[layer] = cand
        return cand

    def _least(self, layer: int):
        """The least (order, slot) of the layer's ``_free``, or None: the top of its heap
        once entries that no longer match ``_free`` are dropped (each entry is dropped
        once, so a layer whose least keeps going costs O(log n) per change, not a scan of
        its residents).  The heap is rebuilt when stale entries outnumber live ones."""
        free = self._free.get(layer)
        if not free:
            return None
        h = self._heaps.get(layer)
        if h is None or len(h) > 8 * len(free) + 64:    # pins and unpins leave stale entries
            h = self._heaps[layer] = [(f, s) for s, f in free.items()]
            heapify(h)
        while h:
            f, s = h[0]
            if free.get(s, _STALE) == f:
                return h[0]
            heappop(h)
        return None

    def victim(self, exclude=()) -> int | None:
        """The largest score's slot: each layer's candidate scored as (steps per expected
        hit, -slot), passed layers apart (any of them goes first).  The scores are kept
        while the cycle's position stays (a fetch's misses choose several victims at
        one position) and rescored where a layer changed; the layers still ahead are
        scored only when no passed layer has a candidate."""
        if exclude:
            return self._victim_scan(exclude)
        if self._fresh:
            self._unpinned_all(self._fresh)
            self._fresh = set()
        if self._moves:
            self._flush_moves()
        c, f, L = self._current, self._first, max(self.layers, 1)
        wrapped = f > c
        ps, ns, dirty = self._pscores, self._nscores, self._dirty
        if (c, f, L) != self._stamp:                  # every layer's distance moved
            self._stamp = (c, f, L)
            ps.clear()
            ns.clear()
            self._ahead = False                       # ns not computed at this position
            todo = [*range(f, L), *range(c + 1)] if wrapped else range(f, c + 1)
        else:
            todo = dirty
        cands, candidate, ahead = self._cand, self._candidate, self._ahead
        for layer in todo:
            if (layer >= f or layer <= c) if wrapped else (f <= layer <= c):
                sc = ps
            elif ahead:
                sc = ns
            else:
                continue
            cand = cands[layer] if layer in cands else candidate(layer)
            if cand is None:
                sc.pop(layer, None)
            else:
                sc[layer] = (((layer - c - 1) % L + 1) / cand[1], -cand[0])
        dirty.clear()
        if ps:
            return -max(ps.values())[1]
        if not ahead:
            self._ahead = True
            for layer in self._by_layer:
                if not ((layer >= f or layer <= c) if wrapped else (f <= layer <= c)):
                    cand = cands[layer] if layer in cands else candidate(layer)
                    if cand is not None:
                        ns[layer] = (((layer - c - 1) % L + 1) / cand[1], -cand[0])
        return -max(ns.values())[1] if ns else None

    def _victim_scan(self, exclude) -> int | None:
        best, best_score = None, None
        for s, key in self._key.items():
            if s in self._holders or s in exclude:
                continue
            sc = (self.score(key), -s)
            if best_score is None or sc > best_score:
                best, best_score = s, sc
        return best

    def evictable(self, exclude=()) -> int:
        return self._unpinned_among(self._key, exclude)

    def admits(self, key, slot: int, confidence: float) -> bool:
        victim = self._key[slot]
        cand = self._cand.get(victim[0])
        # ``slot`` is usually the victim just chosen: its layer's candidate, whose rate
        # ``victim`` has cached as ``score`` computes it (nothing changed since)
        p = cand[1] if cand is not None and cand[0] == slot else None
        return self.score(victim, p) > self.score(key, p=confidence)

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

    def _refiled(self) -> dict:
        """``_free`` computed afresh from the residents, pins and ``usage``."""
        free: dict[int, dict[int, float]] = {}
        order = self.usage.order
        for s, key in self._key.items():
            if s not in self._holders:
                free.setdefault(key[0], {})[s] = order(key)
        return free

    def check(self) -> None:
        """Audit: the pins, ``usage``, and this index against one built from scratch."""
        self.check_pins()
        assert not set().union(self._fresh, *self._pending.values()) & set(self._holders), \
            "a pinned slot waits to be filed"
        self._unpinned_all(self._fresh)
        self._fresh = set()
        for layer, slots in self._pending.items():
            assert all(self._key[s][0] == layer for s in slots), f"a slot pending under layer {layer} is not of it"
        self._file_pending()
        self._flush_moves()
        assert set(self._holders) <= set(self._key), "a pin on a slot the policy does not hold"
        for layer, slots in self._by_layer.items():
            assert all(self._key[s][0] == layer for s in slots)
        assert sum(len(v) for v in self._by_layer.values()) == len(self._key)
        self.usage.check()
        assert {l: f for l, f in self._free.items() if f} == self._refiled(), "unpinned residents misfiled"
        for layer, b in self._best.items():
            free = self._free.get(layer)
            assert b == (min(zip(free.values(), free)) if free else None), f"stale least kept for layer {layer}"
        for layer, s in list(self._cand.items()):
            del self._cand[layer]
            self._best.pop(layer, None)
            self._stamp = None
            assert self._candidate(layer) == s, f"stale candidate cached for layer {layer}"
