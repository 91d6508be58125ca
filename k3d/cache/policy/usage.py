"""How often each expert is used, with forgetting: the statistics the cycle policy ranks by.

``UsageStats`` answers one question for ``CyclePolicy`` (``cycle``): the chance that a
key ``(layer, expert)`` is picked when its layer next comes (``rate``).  It knows
nothing of slots, pins or residents; the policy tells it of visits and uses and
asks it for rates and for each key's order within its layer (``order``).

Layout::

    _visits[layer]   fetches of the layer so far (``visit``: one per fetch per layer)
    _picks[layer]    keys of the layer used over those visits (the layer's mean rate)
    _experts[layer]  highest expert id of the layer seen + 1 (spreads that mean rate)
    _stat[key]       [count, at, order]: the key's decayed count of uses as of its
                     layer's visit ``at``; ``order`` its log count scaled to visit 0,
                     or None after a use until ``order`` is asked for again
    _terms[layer]    (visits, w * prior, seen + w): ``rate``'s terms shared by the
                     layer's keys, kept until the layer's next visit or use

Forgetting (LRFU-style): a use adds 1 and every visit of the key's layer multiplies
the count by ``0.5 ** (1 / half_life)``, applied lazily from ``at``.  ``rate`` shrinks
the count towards the layer's mean rate (``prior_weight`` visits of it), so one use
is not trusted as a sure thing.  Statistics are kept for every key seen, resident
or not: a returning expert keeps its history (one small record per expert).

Invariants (``check``):

- ``at <= _visits[layer]`` for every key (``restore`` clamps a saved one).
- ``order`` is None or equals ``_order_of`` of the record.  Every key of a layer decays
  alike, so this order within a layer changes only when the key is used; ``used``
  clears it, and a use costs no log (every hit a client reports is a use).
- ``_experts[layer]`` exceeds the expert id of every key of the layer, provided
  ``restore`` ran on fresh statistics (the daemon restores at start only): ``used``
  looks only at keys seen the first time.

Export/restore: ``export`` gives the JSON-able form the daemon's ``--state-dir`` file
keeps across a restart, ``restore`` takes it back or raises ValueError having
changed nothing.

Pure: plain numbers, no clock or I/O, so ``k3d replay`` is exact.  The caller's
thread (the policy's: the server thread).
"""

from __future__ import annotations

import math


class UsageStats:
    def __init__(self, half_life: float = 8.0, prior_weight: float = 1.0) -> None:
        self._decay = 0.5 ** (1.0 / half_life)
        self._log_decay = math.log(self._decay)
        self._prior_weight = prior_weight
        self._visits: dict[int, int] = {}
        self._picks: dict[int, int] = {}
        self._experts: dict[int, int] = {}
        self._stat: dict[tuple, list] = {}
        self._terms: dict[int, tuple] = {}

    def visit(self, layer: int) -> None:
        """A fetch for ``layer`` begins: one more chance for each of its experts."""
        self._visits[layer] = self._visits.get(layer, 0) + 1
        self._terms.pop(layer, None)

    def used(self, layer: int, keys) -> None:
        """Each of ``keys``, all of ``layer``, was used, in order.  A few dictionary
        operations per key: every reported hit of every client costs the daemon this."""
        stat, decay, experts = self._stat, self._decay, self._experts
        v = self._visits.get(layer, 0)
        self._picks[layer] = self._picks.get(layer, 0) + len(keys)
        self._terms.pop(layer, None)
        for key in keys:
            st = stat.get(key)
            if st is None:
                stat[key] = [1.0, v, None]
                if key[1] >= experts.get(layer, 0):
                    experts[layer] = key[1] + 1
            else:
                st[0] = st[0] * decay ** (v - st[1]) + 1.0
                st[1] = v
                st[2] = None

    def rate(self, key) -> float:
        """Estimated chance that ``key`` is picked when its layer comes."""
        terms = self._terms.get(key[0])
        if terms is None:
            terms = self._layer_terms(key[0])
        v, wprior, wseen = terms
        st = self._stat.get(key)
        count = st[0] * self._decay ** (v - st[1]) if st else 0.0
        return (count + wprior) / wseen

    def _layer_terms(self, layer: int) -> tuple:
        """``rate``'s terms of ``layer`` now: (visits, w * prior, seen + w)."""
        v = self._visits.get(layer, 0)
        experts = self._experts.get(layer, 1) or 1    # (a restored layer visited, never used, says 0)
        prior = self._picks.get(layer, 0) / v / experts if v else 1.0 / experts
        d = self._decay
        seen = (1.0 - d ** v) / (1.0 - d)             # decayed number of visits observed
        w = self._prior_weight
        terms = self._terms[layer] = (v, w * prior, seen + w)
        return terms

    def order(self, key) -> float:
        """``key``'s order within its layer (larger: more used), which holds between its
        uses; -inf for a key never used.  Computed once per use, then kept."""
        st = self._stat.get(key)
        if st is None:
            return -math.inf
        f = st[2]
        if f is None:
            f = st[2] = self._order_of(st)
        return f

    def orders(self, keys) -> list[float]:
        """``order`` of each of ``keys``, in one call (the filing files a layer's slots
        together)."""
        stat, order_of, out = self._stat, self._order_of, []
        for key in keys:
            st = stat.get(key)
            if st is None:
                out.append(-math.inf)
                continue
            f = st[2]
            if f is None:
                f = st[2] = order_of(st)
            out.append(f)
        return out

    def _order_of(self, st: list) -> float:
        """The log count scaled to visit 0 (-inf for a zero count, which only ``restore``
        can give)."""
        return math.log(st[0]) - st[1] * self._log_decay if st[0] > 0 else -math.inf

    def ranking(self) -> list[tuple]:
        """Every key seen, most likely to be picked first (ties: layer, expert)."""
        return sorted(self._stat, key=lambda k: (-self.rate(k), k))

    def export(self) -> dict:
        """The statistics as JSON-able lists (warm restart)."""
        return {"half_life": round(math.log(0.5) / self._log_decay, 6),
                "layers": [[l, self._visits.get(l, 0), self._picks.get(l, 0), self._experts.get(l, 0)]
                           for l in sorted(set(self._visits) | set(self._experts))],
                "keys": [[k[0], k[1], st[0], st[1]] for k, st in sorted(self._stat.items())]}

    def restore(self, state: dict) -> int:
        """Take saved statistics; ValueError (nothing changed) if they are malformed.
        Returns the number of layers they name (highest layer + 1; 0 for none)."""
        try:
            layers = [(int(l), int(v), int(p), int(e)) for l, v, p, e in state.get("layers", [])]
            keys = [((int(l), int(e)), [float(c), int(v)]) for l, e, c, v in state.get("keys", [])]
        except (TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"malformed cycle-policy statistics: {err}") from None
        if any(v < 0 or p < 0 or e < 0 for _, v, p, e in layers) or any(
                not (0 <= st[0] < 1e9) or st[1] < 0 for _, st in keys):
            raise ValueError("cycle-policy statistics out of range")
        count = 0
        self._terms.clear()
        for l, v, p, e in layers:
            self._visits[l], self._picks[l], self._experts[l] = v, p, e
            count = max(count, l + 1)
        for key, st in keys:                  # an update can't be later than its layer's visits
            st[1] = min(st[1], self._visits.get(key[0], 0))
            st.append(self._order_of(st))
            self._stat[key] = st
            if key[1] >= self._experts.get(key[0], 0):    # (``used`` relies on it)
                self._experts[key[0]] = key[1] + 1
        return count

    def check(self) -> None:
        for layer, terms in list(self._terms.items()):
            del self._terms[layer]
            assert self._layer_terms(layer) == terms, f"stale rate terms kept for layer {layer}"
        for key, st in self._stat.items():
            assert 0 <= st[1] <= self._visits.get(key[0], 0), f"use of {key} later than its layer's visits"
            assert st[2] is None or st[2] == self._order_of(st), f"stale order kept for {key}"
