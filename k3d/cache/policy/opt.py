"""Belady's OPT under k3d's pin rules: the offline bound ``k3d replay`` prints.

Not a daemon policy: it needs the future.  ``OptPolicy(future)`` is given the
fetched keys of the whole run in request order; the store calls ``insert``/
``touch`` exactly once per fetched key in that order (its determinism rule), so a
cursor tells where in the future each call stands.  The victim is the unpinned
slot whose key is requested again furthest in the future (never again: first),
ties by lower slot.  Predictions are not replayed with OPT (it knows the future).

Victims come from a max-heap of (next use, slot) with lazy deletion: an entry is
live while its slot still holds the key with that next use and is unpinned;
popped pinned slots are parked and pushed again when their last pin goes.
"""

from __future__ import annotations

import heapq

from k3d.cache.policy.base import PinTable

NEVER = 1 << 62


def next_uses(keys: list) -> list[int]:
    """For each position, the next position requesting the same key (NEVER if none)."""
    out = [NEVER] * len(keys)
    last: dict = {}
    for i in range(len(keys) - 1, -1, -1):
        k = keys[i]
        out[i] = last.get(k, NEVER)
        last[k] = i
    return out


class OptPolicy(PinTable):
    name = "opt"

    def __init__(self, future: list, layers: int = 0) -> None:
        super().__init__()
        self._next = next_uses(future)
        self._cursor = 0
        self._due: dict[int, int] = {}        # resident slot -> next use of its key
        self._heap: list[tuple[int, int]] = []   # (-next use, slot)
        self._parked: set[int] = set()

    def visit(self, layer: int) -> None:
        pass

    def _request(self, slot: int) -> None:
        due = self._next[self._cursor]
        self._cursor += 1
        self._due[slot] = due
        self._parked.discard(slot)
        heapq.heappush(self._heap, (-due, slot))

    def insert(self, slot: int, key=None, predicted: bool = False) -> None:
        if predicted:
            raise ValueError("OPT replays fetches only")
        self._request(slot)

    def touch(self, slot: int, key=None) -> None:
        self._request(slot)

    def demote(self, slot: int) -> None:
        pass

    def remove(self, slot: int) -> None:
        self._due.pop(slot, None)
        self._parked.discard(slot)
        self._forget_pins(slot)

    def has(self, slot: int) -> bool:
        return slot in self._due

    def _unpinned(self, slot: int) -> None:
        if slot in self._parked:
            self._parked.discard(slot)
            heapq.heappush(self._heap, (-self._due[slot], slot))

    def victim(self, exclude=()) -> int | None:
        heap, held = self._heap, []
        found = None
        while heap:
            neg, slot = heap[0]
            if self._due.get(slot) != -neg:
                heapq.heappop(heap)                 # stale
            elif slot in self._holders:
                heapq.heappop(heap)
                self._parked.add(slot)
            elif slot in exclude:
                held.append(heapq.heappop(heap))
            else:
                found = slot
                break
        for entry in held:
            heapq.heappush(heap, entry)
        return found

    def evictable(self, exclude=()) -> int:
        return self._unpinned_among(self._due, exclude)

    def admits(self, key, slot: int, confidence: float) -> bool:
        return True

    def check(self) -> None:
        self.check_pins()
