"""Each layer's unpinned residents, filed by order: the cycle policy's victim index.

Within a layer the cycle distance ``d`` is shared, so a layer's victim candidate is
its unpinned resident with the least ``usage.order`` (its decayed count, comparable
within a layer and changing only when the key is used).  Each layer keeps its filed
unpinned residents with that value (``_free``) and their least (``_best``), updated
as they change: a change to any other slot moves the least only if the new value is
below it, so the least is found again only when it is itself pinned, evicted or
used, from a heap of the layer's filed values (``_heaps``; entries that no longer
match ``_free`` are dropped as they surface): O(log n) in its layer, not a scan.

Filed late, on purpose: a slot that may become a victim (its last pin gone; or
inserted unpinned and still so at the next victim, ``_fresh``) waits unfiled in its
layer's ``_pending`` until that layer's candidate is next asked for
(``_candidate``).  A fetch's miss, pinned at once, is never filed, and neither is a
slot a token's end unpins and the next token pins again before its layer is scored:
a token's end releases every pin its client held, and most are the next token's
hits.  Filing later gives the same ``_free``: a key's order changes only with a use,
and filing reads it then.  An unpinned filed resident used waits in ``_moves`` (a
use only raises its order, so a batch of them has one outcome in any order).  The
candidate's rate changes with every visit and use of its layer, so it is cached
apart (``_cand``) until then, and the layer goes into ``_dirty`` for the policy to
score again.  ``check_filing`` recomputes all of it from scratch and compares.

Layout::

    _key[slot]        resident slot -> key;  _by_layer[layer]: its resident slots
    _free[layer]      {filed unpinned resident slot: its usage.order}
    _best[layer]      least (order, slot) of _free[layer] (absent: stale; None: empty)
    _heaps[layer]     heap of (order, slot) filed in _free[layer] (lazy: stale entries surface)
    _cand[layer]      (slot, rate) of _best's slot (absent: stale)
    _dirty            layers whose _cand went since the policy scored them
    _pending[layer]   unpinned residents of the layer not yet filed
    _fresh            inserted unpinned, not yet pending (most are pinned at once)
    _moves            filed unpinned residents used since, not yet refiled

Invariants (``check_filing``): a slot is in at most one of ``_fresh``, ``_pending`` and
``_free``, and only while unpinned and resident; once ``_fresh``, ``_pending`` and
``_moves`` are filed, ``_free`` equals the residents' unpinned slots by their current
order, ``_best`` each layer's least, ``_cand`` its slot and rate.

Pure, like every policy (``base``); the store's thread.
"""

from __future__ import annotations

from heapq import heapify, heappop, heappush
from typing import Any

from k3d.cache.policy.base import PinTable
from k3d.cache.policy.usage import UsageStats

_STALE: Any = object()                                 # a cache entry to compute again


class LayerFiling(PinTable):
    """The victim index of ``CyclePolicy`` (module docstring): a layer's least-order
    unpinned resident, kept as pins, releases, uses and evictions change it."""

    def __init__(self, usage: UsageStats) -> None:
        super().__init__()
        self.usage = usage                            # k3d.cache.policy.usage.UsageStats
        self._key: dict[int, tuple] = {}              # resident slot -> key
        self._by_layer: dict[int, set[int]] = {}      # layer -> resident slots
        self._free: dict[int, dict[int, float]] = {}  # layer -> {unpinned resident slot: its usage.order}
        self._best: dict[int, Any] = {}        # layer -> least (order, slot) of _free (absent: stale)
        self._heaps: dict[int, list] = {}             # layer -> heap of (order, slot) filed in _free (lazy)
        self._cand: dict[int, Any] = {}        # layer -> (slot, rate) of _best's slot (absent: stale)
        self._dirty: set[int] = set()                 # layers whose _cand went since ``victim`` scored them
        self._pending: dict[int, set[int]] = {}       # layer -> unpinned residents not yet in _free
        self._fresh: set[int] = set()                 # inserted unpinned, not yet pending (most get pinned)
        self._moves: set[int] = set()                 # unpinned residents used, not yet refiled

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

    def _pinned(self, slot: int) -> None:
        fresh = self._fresh
        if slot in fresh:                  # (a miss or a prediction, pinned as it is inserted)
            fresh.discard(slot)
        else:
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

    def _file_fresh(self) -> None:
        """The slots inserted unpinned and still unpinned go pending (most were pinned at once)."""
        fresh, self._fresh = self._fresh, set()
        self._unpinned_all(fresh)

    def _file_pending(self) -> None:
        """File every layer's pending slots (restore and audit want ``_free`` whole)."""
        pending, self._pending = self._pending, {}
        for layer, slots in pending.items():
            if slots:
                self._file(layer, slots)

    def _file(self, layer: int, slots) -> None:
        """File ``slots`` (unpinned residents of ``layer``) in ``_free`` by their order now."""
        slots = list(slots)
        fs = self.usage.orders([self._key[s] for s in slots])   # (used while pinned: computed now)
        free = self._free.get(layer)
        if free is None:
            free = self._free[layer] = {}
        free.update(zip(slots, fs))
        filed = list(zip(fs, slots))
        h = self._heaps.get(layer)
        if h is not None:
            for e in filed:
                heappush(h, e)
        b = self._best.get(layer, _STALE)
        if b is not _STALE:              # a stale least stays so (``_least`` finds it)
            least = min(filed)
            if b is None or least < b:
                self._best[layer] = least

    def _candidate(self, layer: int):
        """(slot, rate) of the layer's best victim, or None; cached until the layer changes."""
        if self._fresh:
            self._file_fresh()
        if self._moves:
            self._flush_moves()
        cand = self._cand.get(layer, _STALE)
        return self._refresh(layer) if cand is _STALE else cand

    def _refresh(self, layer: int):
        """``_candidate`` of a layer whose candidate is stale, once ``_fresh`` and ``_moves``
        are filed (``victim`` files them once, then refreshes each changed layer)."""
        waiting = self._pending.get(layer)
        if waiting:
            self._pending[layer] = set()
            self._file(layer, waiting)           # (no pending slot is in _moves: only filed ones)
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

    def _refiled(self) -> dict:
        """``_free`` computed afresh from the residents, pins and ``usage``."""
        free: dict[int, dict[int, float]] = {}
        order = self.usage.order
        for s, key in self._key.items():
            if s not in self._holders:
                free.setdefault(key[0], {})[s] = order(key)
        return free

    def check_filing(self) -> None:
        """Audit: file what waits, then compare the index with one built from scratch."""
        assert not set().union(self._fresh, *self._pending.values()) & set(self._holders), \
            "a pinned slot waits to be filed"
        self._file_fresh()
        for layer, slots in self._pending.items():
            assert all(self._key[s][0] == layer for s in slots), f"a slot pending under layer {layer} is not of it"
        self._file_pending()
        self._flush_moves()
        for layer, slots in self._by_layer.items():
            assert all(self._key[s][0] == layer for s in slots)
        assert sum(len(v) for v in self._by_layer.values()) == len(self._key)
        assert {l: f for l, f in self._free.items() if f} == self._refiled(), "unpinned residents misfiled"
        for layer, b in self._best.items():
            free = self._free.get(layer)
            assert b == (min(zip(free.values(), free)) if free else None), f"stale least kept for layer {layer}"
        for layer, s in list(self._cand.items()):
            del self._cand[layer]
            self._best.pop(layer, None)
            assert self._candidate(layer) == s, f"stale candidate cached for layer {layer}"
