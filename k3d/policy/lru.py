"""Eviction policy: LRU order plus pins.  Pure: plain integers, no I/O, no clock.

The policy *chooses*; the store *evicts* (as in Plasma).  Slots are integers,
holders are any hashable (the store uses ``(client_id, epoch)``).

State:
- ``_order``: the ready slots, least recently used first (an OrderedDict used
  as an ordered set).  Free and loading slots are not in it.
- ``_pins``: holder -> set of slots; ``_holders``: slot -> set of holders.

Invariants (checked by ``check``):
- a slot in ``_holders`` is never returned by ``victim``;
- ``_holders`` and ``_pins`` are the same relation seen from both sides.

Pins may be taken on slots that are not (yet) ready: a fetch pins a loading
slot so that once it becomes ready it cannot be evicted before the client's
next epoch.
"""

from __future__ import annotations

from collections import OrderedDict


class LruPolicy:
    def __init__(self):
        self._order: OrderedDict[int, None] = OrderedDict()
        self._pins: dict[object, set[int]] = {}
        self._holders: dict[int, set] = {}

    # -- recency ------------------------------------------------------------
    def insert(self, slot: int) -> None:
        """A slot became ready: most recently used."""
        self._order[slot] = None
        self._order.move_to_end(slot)

    def touch(self, slot: int) -> None:
        self._order.move_to_end(slot)

    def demote(self, slot: int) -> None:
        """Move to the LRU end: the next victim unless pinned."""
        self._order.move_to_end(slot, last=False)

    def remove(self, slot: int) -> None:
        """The store evicted or dropped the slot: forget its recency and pins."""
        self._order.pop(slot, None)
        for holder in self._holders.pop(slot, ()):
            held = self._pins[holder]
            held.discard(slot)
            if not held:
                del self._pins[holder]

    def is_ready(self, slot: int) -> bool:
        return slot in self._order

    # -- pins ---------------------------------------------------------------
    def pin(self, slot: int, holder) -> bool:
        """Pin ``slot`` for ``holder``; False if the holder already had it."""
        held = self._pins.setdefault(holder, set())
        if slot in held:
            return False
        held.add(slot)
        self._holders.setdefault(slot, set()).add(holder)
        return True

    def release(self, holder) -> list[int]:
        """Drop every pin of ``holder``; returns the slots it held."""
        held = self._pins.pop(holder, set())
        for slot in held:
            hs = self._holders[slot]
            hs.discard(holder)
            if not hs:
                del self._holders[slot]
        return sorted(held)

    def pinned(self, slot: int) -> bool:
        return slot in self._holders

    def held(self, holder) -> set[int]:
        return self._pins.get(holder, set())

    def pinned_count(self) -> int:
        return len(self._holders)

    # -- choosing -----------------------------------------------------------
    def victim(self, exclude=()) -> int | None:
        """The least recently used ready, unpinned slot not in ``exclude``."""
        for slot in self._order:
            if slot not in self._holders and slot not in exclude:
                return slot
        return None

    def evictable(self, exclude=()) -> int:
        """How many ready slots could be evicted, not counting ``exclude``."""
        return sum(1 for s in self._order if s not in self._holders and s not in exclude)

    def lru_order(self) -> list[int]:
        return list(self._order)

    def check(self) -> None:
        seen: dict[int, set] = {}
        for holder, held in self._pins.items():
            assert held, f"empty pin set kept for {holder!r}"
            for s in held:
                seen.setdefault(s, set()).add(holder)
        assert seen == self._holders, (seen, self._holders)
