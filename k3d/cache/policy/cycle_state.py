"""The cycle policy's statistics across a restart (``ranking``, ``export``,
``restore``) and its audit against a full scan (``check``).

A mixin of ``CyclePolicy`` (``cycle``), apart because it is a concern of its own:
the JSON-able form of the per-layer visit counts and per-key decayed counts that
the daemon's ``--state-dir`` file keeps.  It reads and writes ``CyclePolicy``'s
fields (``_visits``, ``_picks``, ``_experts``, ``_stat``) and, after a restore,
rebuilds its index (``_refiled``, the caches cleared), so the policy's invariants
hold as after any other change.  ``check`` recomputes that index from scratch and
compares (the tests call it after every step).  Pure, like the policy;
the caller's thread.
"""

from __future__ import annotations

import math


class CycleState:
    """Warm-restart statistics and the audit of ``CyclePolicy`` (which supplies every field used here)."""

    def ranking(self, slot_key=None) -> list[tuple]:
        """Every key seen, most likely to be picked first (ties: layer, expert)."""
        return sorted(self._stat, key=lambda k: (-self.rate(k), k))

    def export(self) -> dict:
        """The statistics as JSON-able lists (warm restart)."""
        return {"half_life": round(math.log(0.5) / self._log_decay, 6),
                "layers": [[l, self._visits.get(l, 0), self._picks.get(l, 0), self._experts.get(l, 0)]
                           for l in sorted(set(self._visits) | set(self._experts))],
                "keys": [[k[0], k[1], st[0], st[1]] for k, st in sorted(self._stat.items())]}

    def restore(self, state: dict) -> None:
        """Take saved statistics; ValueError (nothing changed) if they are malformed."""
        try:
            layers = [(int(l), int(v), int(p), int(e)) for l, v, p, e in state.get("layers", [])]
            keys = [((int(l), int(e)), [float(c), int(v)]) for l, e, c, v in state.get("keys", [])]
        except (TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"malformed cycle-policy statistics: {e}") from None
        if any(v < 0 or p < 0 or e < 0 for _, v, p, e in layers) or any(
                not (0 <= st[0] < 1e9) or st[1] < 0 for _, st in keys):
            raise ValueError("cycle-policy statistics out of range")
        for l, v, p, e in layers:
            self._visits[l], self._picks[l], self._experts[l] = v, p, e
            self.layers = max(self.layers, l + 1)
        for key, st in keys:                  # an update can't be later than its layer's visits
            st[1] = min(st[1], self._visits.get(key[0], 0))
            st.append(self._forward(st))
            self._stat[key] = st
            if key[1] >= self._experts.get(key[0], 0):    # (``_used_layer`` relies on it)
                self._experts[key[0]] = key[1] + 1
        self._fresh.clear()
        self._moves.clear()
        self._free = self._refiled()
        self._best.clear()
        self._heaps.clear()
        self._cand.clear()
        self._stamp = None

    def _refiled(self) -> dict:
        """``_free`` computed afresh from the residents, pins and statistics."""
        free: dict[int, dict[int, float]] = {}
        for s, key in self._key.items():
            if s not in self._holders:
                st = self._stat.get(key)
                free.setdefault(key[0], {})[s] = self._forward(st) if st is not None else -math.inf
        return free

    def check(self) -> None:
        self.check_pins()
        assert not self._fresh & set(self._holders), "a pinned slot waits to be filed"
        self._file_fresh()
        self._flush_moves()
        assert set(self._holders) <= set(self._key), "a pin on a slot the policy does not hold"
        for layer, slots in self._by_layer.items():
            assert all(self._key[s][0] == layer for s in slots)
        assert sum(len(v) for v in self._by_layer.values()) == len(self._key)
        for key, st in self._stat.items():
            assert st[2] is None or st[2] == self._forward(st), f"stale order kept for {key}"
        assert {l: f for l, f in self._free.items() if f} == self._refiled(), "unpinned residents misfiled"
        for layer, b in self._best.items():
            free = self._free.get(layer)
            assert b == (min(zip(free.values(), free)) if free else None), f"stale least kept for layer {layer}"
        for layer, s in list(self._cand.items()):
            del self._cand[layer]
            self._best.pop(layer, None)
            self._stamp = None
            assert self._candidate(layer) == s, f"stale candidate cached for layer {layer}"
