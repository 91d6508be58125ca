"""The MoE-aware policy (``--policy cycle``, the default).  Pure: see ``base``.

MoE layers run in a fixed cycle 0..L-1 per token, so an expert's next use is
bounded below by where its layer lies in the cycle: an expert of a layer this
token has just passed is not needed for almost L layer steps, one of the next
layer may be needed at the very next step.  Plain LRU gets this backwards: its
least recently used experts are the next token's first layers.

Each slot is scored by its expected time to next use, in layer steps::

    eta(key) = d(layer) + L * (1 / p - 1)

``d`` is how many layer steps until the key's layer comes again (1 for the layer
after the one being served, L for the one being served now).  ``p`` estimates the
chance the key is picked when its layer comes: a decayed count of its uses
(LRFU-style forgetting, half-life ``half_life`` visits of its layer), shrunk towards
the layer's average rate so a key seen once is not trusted as a sure thing.  The
victim is the unpinned slot with the largest ``eta`` (ties: lower slot).  Visits
are counted per layer (``visit``), so several clients at different places in the
cycle all count as chances for a key to be picked.

Statistics are kept for every key seen, resident or not (a returning expert keeps
its history), so memory is one small record per expert of the model.

Background reads (``admits``): a prediction may evict a slot only if the slot's
expected time to next use is longer than the prediction's (the predicted key's
layer distance with the predicting client's measured precision as ``p``).
"""

from __future__ import annotations

from .base import PinTable


class CyclePolicy(PinTable):
    name = "cycle"

    def __init__(self, layers: int = 0, half_life: float = 8.0, prior_weight: float = 1.0):
        super().__init__()
        self.layers = layers              # L; learned from keys when 0
        self._decay = 0.5 ** (1.0 / half_life)
        self._prior_weight = prior_weight
        self._visits: dict[int, int] = {}             # layer -> visits so far
        self._picks: dict[int, int] = {}              # layer -> keys used in those visits
        self._experts: dict[int, int] = {}            # layer -> highest expert id + 1 seen
        self._stat: dict[tuple, list] = {}            # key -> [decayed count, visit of last update]
        self._key: dict[int, tuple] = {}              # resident slot -> key
        self._current = -1                            # the layer being served (last visited)

    # -- requests -------------------------------------------------------------
    def visit(self, layer: int) -> None:
        """A fetch for ``layer`` begins: one more chance for each of its experts."""
        self._visits[layer] = self._visits.get(layer, 0) + 1
        self._current = layer
        if layer >= self.layers:
            self.layers = layer + 1

    def _used(self, key) -> None:
        layer, expert = key
        v = self._visits.get(layer, 0)
        st = self._stat.get(key)
        if st is None:
            self._stat[key] = [1.0, v]
        else:
            st[0] = st[0] * self._decay ** (v - st[1]) + 1.0
            st[1] = v
        self._picks[layer] = self._picks.get(layer, 0) + 1
        if expert >= self._experts.get(layer, 0):
            self._experts[layer] = expert + 1

    def insert(self, slot: int, key=None, predicted: bool = False) -> None:
        self._key[slot] = key
        if predicted:                     # a guess is not a use
            layer, expert = key
            if expert >= self._experts.get(layer, 0):
                self._experts[layer] = expert + 1
            return
        self._used(key)

    def touch(self, slot: int, key=None) -> None:
        self._used(self._key[slot] if key is None else key)

    def demote(self, slot: int) -> None:
        """An unused prediction: nothing to undo (a guess never counted as a use)."""

    def remove(self, slot: int) -> None:
        self._key.pop(slot, None)
        self._forget_pins(slot)

    def has(self, slot: int) -> bool:
        return slot in self._key

    # -- scoring --------------------------------------------------------------
    def rate(self, key) -> float:
        """Estimated chance that ``key`` is picked when its layer comes."""
        layer = key[0]
        v = self._visits.get(layer, 0)
        experts = self._experts.get(layer, 1)
        prior = self._picks.get(layer, 0) / v / experts if v else 1.0 / max(experts, 1)
        d = self._decay
        seen = (1.0 - d ** v) / (1.0 - d)             # decayed number of visits observed
        st = self._stat.get(key)
        count = st[0] * d ** (v - st[1]) if st else 0.0
        w = self._prior_weight
        return (count + w * prior) / (seen + w)

    def distance(self, layer: int) -> int:
        """Layer steps until ``layer`` is served again (1 = next, L = the current one)."""
        L = max(self.layers, 1)
        return (layer - self._current - 1) % L + 1

    def eta(self, key, p: float | None = None) -> float:
        p = self.rate(key) if p is None else p
        return self.distance(key[0]) + max(self.layers, 1) * (1.0 / max(p, 1e-6) - 1.0)

    def victim(self, exclude=()) -> int | None:
        best, best_eta = None, -1.0
        holders = self._holders
        for slot, key in self._key.items():
            if slot in holders or slot in exclude:
                continue
            e = self.eta(key)
            if e > best_eta or (e == best_eta and slot < best):
                best, best_eta = slot, e
        return best

    def evictable(self, exclude=()) -> int:
        return sum(1 for s in self._key if s not in self._holders and s not in exclude)

    def admits(self, key, slot: int, confidence: float) -> bool:
        return self.eta(self._key[slot]) > self.eta(key, p=confidence)

    def snapshot(self):
        """Comparable state (tests: a refused request changes nothing)."""
        return (dict(self._key), {k: tuple(v) for k, v in self._stat.items()}, dict(self._visits),
                self._current)

    # -- warm restart ---------------------------------------------------------
    def hot(self, n: int) -> list[tuple]:
        """The ``n`` keys most likely to be picked: rows (layer, expert, rate)."""
        rows = sorted(((k[0], k[1], self.rate(k)) for k in self._stat), key=lambda r: (-r[2], r[0], r[1]))
        return rows[:n]

    def load_hot(self, rows) -> None:
        pass

    def check(self) -> None:
        self.check_pins()
        assert set(self._holders) <= set(self._key) | set(self._holders)
