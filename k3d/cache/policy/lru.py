"""Plain LRU plus pins (``--policy lru``).  Pure: see ``base``.

State: ``_order``, the resident slots (loading or ready), least recently
*requested* first: an OrderedDict used as an ordered set.  A slot enters it when its
key is requested (``insert``), not when its read completes, so the order is a
function of the request sequence alone.  Free slots are not in it.

Invariant (``check``): a pinned slot is never returned by ``victim``.
"""

from __future__ import annotations

from collections import OrderedDict

from k3d.cache.policy.base import PinTable


class LruPolicy(PinTable):
    name = "lru"

    def __init__(self, layers: int = 0) -> None:
        super().__init__()
        self._order: OrderedDict[int, None] = OrderedDict()

    # -- recency ------------------------------------------------------------
    def visit(self, layer: int) -> None:
        """A fetch for ``layer`` begins (LRU does not use the layer cycle)."""

    def insert(self, slot: int, key=None, predicted: bool = False) -> None:
        """The slot's key was requested (or predicted): most recently used."""
        self._order[slot] = None
        self._order.move_to_end(slot)

    def touch(self, slot: int, key=None) -> None:
        self._order.move_to_end(slot)

    def demote(self, slot: int) -> None:
        """Move to the LRU end: the next victim unless pinned."""
        self._order.move_to_end(slot, last=False)

    def remove(self, slot: int) -> None:
        """The store evicted or dropped the slot: forget its recency and pins."""
        self._order.pop(slot, None)
        self._forget_pins(slot)

    def has(self, slot: int) -> bool:
        return slot in self._order

    # -- choosing -----------------------------------------------------------
    def victim(self, exclude=()) -> int | None:
        """The least recently used unpinned slot not in ``exclude``."""
        for slot in self._order:
            if slot not in self._holders and slot not in exclude:
                return slot
        return None

    def evictable(self, exclude=()) -> int:
        """How many slots could be evicted, not counting ``exclude``."""
        return self._unpinned_among(self._order, exclude)

    def admits(self, key, slot: int, confidence: float) -> bool:
        """LRU knows nothing of reuse: a prediction may evict any unpinned slot."""
        return True

    # -- warm restart ---------------------------------------------------------
    def ranking(self, slot_key) -> list[tuple]:
        """Resident keys, most recently requested first (``slot_key``: the store's slot -> key)."""
        return [slot_key[s] for s in reversed(self._order)]

    def export(self) -> dict:
        return {}

    def restore(self, state: dict) -> None:
        """LRU keeps no statistics beyond the order, which the pre-load rebuilds."""

    def check(self) -> None:
        self.check_pins()
        assert set(self._holders) <= set(self._order), "a pin on a slot the policy does not hold"
