"""The cycle policy's victim order and its index over layers (``CyclePolicy`` is built on it).

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

Index (so a victim costs O(log L), not O(slots)): within a layer ``d`` is shared, so
its candidate is its unpinned resident with the least ``usage.order``, kept by
``LayerFiling`` (``filing``, which states its layout and invariants) with its rate
(``_cand``).  Across layers, at one position of the cycle (``_stamp``: current,
first, layers), each passed layer's candidate has an entry ``(-score, slot, layer)``
(least first: the largest score, then the lower slot)::

    _pscores[layer]  its entry now (absent: no candidate)
    _pheap           every entry pushed at this position: a heap, where an entry
                     that no longer equals its layer's is dropped as it surfaces
    _nscores[layer]  the entry of a layer ahead, all scored once per position
                     and only when no passed layer has a candidate (``_ahead``)

A new position scores every passed layer afresh (``_rescore_passed``: the distances
all moved); at the same position only the layers in ``_dirty`` (their candidate
changed) are rescored and pushed (``_pick``).  Invariant, when ``victim`` returns:
``_pscores`` holds the score of every passed layer's current candidate, and the least
entry of ``_pheap`` equal to its layer's is the least of ``_pscores``.  So a victim at
an unchanged position costs its own layer's rescoring, not a pass over every passed
layer; ``victims`` (the store's evictions ahead) rescores only the victim's layer
between victims, since a removal changes nothing else.

Pure, like every policy (``base``); the store's thread.  The position (``_current``,
``_first``, ``layers``) is moved by the subclass's ``visit`` and inserts.
"""

from __future__ import annotations

from heapq import heapify, heappop, heappush
from typing import Any

from k3d.cache.policy.filing import LayerFiling
from k3d.cache.policy.usage import UsageStats


class CycleOrder(LayerFiling):
    """The victim order of ``CyclePolicy`` (module docstring): its scores, kept per
    position of the cycle, and the victims they give."""

    def __init__(self, usage: UsageStats, layers: int = 0) -> None:
        super().__init__(usage)
        self.layers = layers                          # L; grows with the keys seen
        self._pscores: dict[int, tuple] = {}          # passed layer -> its candidate's (-score, slot, layer)
        self._pheap: list[tuple] = []                 # _pscores' entries as pushed (lazy: stale ones stay)
        self._nscores: dict[int, tuple] = {}          # layer ahead -> its entry, when _ahead
        self._ahead = False
        self._stamp: Any = None                       # (current, first, layers) the scores are for
        self._current = -1                            # the layer being served (last visited)
        self._first = -1                              # the first layer of the current pass

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

    def victim(self, exclude=()) -> int | None:
        """The largest score's slot: each layer's candidate scored as (steps per expected
        hit, -slot), passed layers apart (any of them goes first).  The scores are kept
        while the cycle's position stays (a fetch's misses choose several victims at
        one position) and rescored where a layer changed; the layers still ahead are
        scored only when no passed layer has a candidate.

        The passed layers' entries ``(-score, slot, layer)`` (least first: the largest
        score, then the lower slot) are kept in ``_pscores`` and pushed onto ``_pheap``;
        an entry that no longer equals its layer's is dropped as it surfaces (an equal one
        names the same slot at the same score: either may be taken).
        So a victim at an unchanged position costs its own layer's rescoring, not a
        pass over every passed layer."""
        if exclude:
            return self._victim_scan(exclude)
        if self._fresh:
            self._file_fresh()
        if self._moves:
            self._flush_moves()
        c, f, L = self._current, self._first, max(self.layers, 1)
        if (c, f, L) != self._stamp:                  # every layer's distance moved
            self._stamp = (c, f, L)
            self._nscores.clear()
            self._ahead = False                       # ns not computed at this position
            self._rescore_passed([*range(f, L), *range(c + 1)] if f > c else range(f, c + 1), c, L)
            self._dirty.clear()
        return self._pick(c, f, L)

    def _pick(self, c: int, f: int, L: int) -> int | None:
        """``victim`` once what waits is filed and the position scored: the changed layers
        rescored, then the largest entry still its layer's."""
        ps, dirty = self._pscores, self._dirty
        if dirty:
            cands, refresh, heap, wrapped = self._cand, self._refresh, self._pheap, f > c
            for layer in dirty:
                if (layer >= f or layer <= c) if wrapped else (f <= layer <= c):
                    cand = cands[layer] if layer in cands else refresh(layer)
                    if cand is None:
                        ps.pop(layer, None)
                    else:
                        e = ps[layer] = _entry(layer, cand, c, L)
                        heappush(heap, e)
                elif self._ahead:
                    cand = cands[layer] if layer in cands else refresh(layer)
                    if cand is None:
                        self._nscores.pop(layer, None)
                    else:
                        self._nscores[layer] = _entry(layer, cand, c, L)
        dirty.clear()
        s = self._top()
        return self._victim_ahead(c, f, L) if s is None else s

    def _top(self) -> int | None:
        """The slot of the least entry of ``_pheap`` still equal to its layer's in
        ``_pscores`` (stale ones dropped on the way), or None when ``_pscores`` is empty."""
        ps, heap = self._pscores, self._pheap
        while ps:
            e = heap[0]
            if ps.get(e[2]) == e:
                return e[1]
            heappop(heap)
        return None

    def victims(self, n: int, loading) -> tuple[list[int], int]:
        """``PinTable.victims``: after the first, each victim is ``_pick``ed directly, since a
        removal files nothing and moves no position (only the victim's layer changed).

        The usual victim, the filed least of a passed layer whose entry is on top, is
        removed and its layer rescored here in one step (``_next_of``): what ``remove``
        and ``_pick`` do for it, without the checks that cannot apply (it is filed, so
        neither fresh nor pending; a victim holds no pin; its layer, the one changed)."""
        out: list[int] = []
        skips = 0
        if n <= 0:
            return out, skips
        s = self.victim()
        c, f, L = self._stamp
        pick, remove, next_of = self._pick, self.remove, self._next_of
        ps, bests, key_of = self._pscores, self._best, self._key
        while s is not None:
            if s in loading:
                skips += 1
                s = self._victim_scan(loading)
                if s is None:
                    break
            layer = key_of[s][0]
            e, b = ps.get(layer), bests.get(layer)
            if e is not None and e[1] == s and b is not None and b[1] == s:
                out.append(s)
                if len(out) == n:
                    remove(s)
                    break
                s = next_of(s, layer, c, L)
                if s is None:
                    s = self._victim_ahead(c, f, L)
            else:
                remove(s)
                out.append(s)
                if len(out) == n:
                    break
                s = pick(c, f, L)
        return out, skips

    def _next_of(self, s: int, layer: int, c: int, L: int) -> int | None:
        """``remove(s)`` then ``_pick``, for ``s`` the filed least of passed ``layer``, whose
        entry tops ``_pheap`` (``victims``): the layer's next least becomes its candidate,
        then the top entry still its layer's is the next victim (None: no passed layer has
        a candidate).  Nothing else changed, so no other layer is rescored."""
        del self._key[s]
        del self._free[layer][s]
        self._by_layer[layer].discard(s)
        del self._best[layer]                         # (the least went: ``_refresh`` finds the next)
        cand = self._refresh(layer)
        if cand is None:
            del self._pscores[layer]
        else:
            e = self._pscores[layer] = _entry(layer, cand, c, L)
            heappush(self._pheap, e)
        return self._top()

    def _victim_ahead(self, c: int, f: int, L: int) -> int | None:
        """``victim`` when no passed layer has a candidate: the largest score of the layers
        ahead (``_nscores``, all of them scored once per position)."""
        ns = self._nscores
        if not self._ahead:
            self._ahead = True
            cands, refresh, wrapped = self._cand, self._refresh, f > c
            for layer in self._by_layer:
                if not ((layer >= f or layer <= c) if wrapped else (f <= layer <= c)):
                    cand = cands[layer] if layer in cands else refresh(layer)
                    if cand is not None:
                        ns[layer] = _entry(layer, cand, c, L)
        return min(ns.values())[1] if ns else None

    def _rescore_passed(self, passed, c: int, L: int) -> None:
        """``_pscores`` and ``_pheap`` afresh for the ``passed`` layers at position ``c``."""
        ps, cands, refresh = self._pscores, self._cand, self._refresh
        ps.clear()
        heap = []
        for layer in passed:
            cand = cands[layer] if layer in cands else refresh(layer)
            if cand is not None:
                e = ps[layer] = _entry(layer, cand, c, L)
                heap.append(e)
        heapify(heap)
        self._pheap = heap

    def _victim_scan(self, exclude) -> int | None:
        best, best_score = None, None
        for s, key in self._key.items():
            if s in self._holders or s in exclude:
                continue
            sc = (self.score(key), -s)
            if best_score is None or sc > best_score:
                best, best_score = s, sc
        return best


def _entry(layer: int, cand: tuple, c: int, L: int) -> tuple:
    """A passed layer's heap entry at position ``c``: (-score, slot, layer), ``cand`` its
    candidate (slot, rate); the score is the layer steps until it is served again per
    expected hit."""
    return (-((layer - c - 1) % L + 1) / cand[1], cand[0], layer)
