"""Pin bookkeeping shared by every policy, and the policy protocol the store calls.

A policy is pure: plain integers and tuples, no I/O, clock, threads or randomness,
so the same request sequence gives the same victims (``k3d replay`` relies on it).
The policy *chooses*; the store *evicts* (as in Plasma).  Slots are integers,
keys ``(layer, expert)``, holders any hashable (the store uses ``(client, epoch)``
and ``("predict", client)``).

The protocol (the store is the only caller, always on the server thread)::

    insert(slot, key, predicted=False)  key requested now (a miss, or a prediction):
                                        it enters the order at request time, even
                                        though its read has not finished
    insert_pinned(slot, key, predicted, holder)
                                        ``insert`` then ``pin(slot, holder)``
    replace(slot, key, predicted, holder)
                                        ``remove(slot)`` then ``insert_pinned``: a
                                        victim's slot taken by a miss or a prediction
    touch(slot, key)                    key requested now and resident (a hit)
    hear_all(fetches)                   visit + touches of several fetches of hits, in order
    demote(slot)                        an unused prediction: next victim unless pinned
    remove(slot)                        the store evicted or dropped the slot
    victim(exclude=())                  the slot to evict, or None
    victims(n, loading)                 up to n victims, none in ``loading``, each
                                        removed as it is chosen (evictions ahead)
    evictable(exclude=())               how many slots victim() could return
    admits(key, slot, confidence)       may a background read of ``key`` evict ``slot``?
    ranking(slot_key)                   keys hottest first (a warm restart pre-loads them)
    export() / restore(state)           the statistics a warm restart keeps (JSON-able)

State here: ``_pins`` (holder -> set of slots) and ``_holders`` (slot -> set of
holders), the same relation seen from both sides (``check_pins``).  A pinned slot is
never returned by ``victim``.  Pins may be taken on slots whose read is still in
flight: a fetch pins a loading slot so that once ready it cannot be evicted before
the client's next epoch.
"""

from __future__ import annotations


class PinTable:
    """The pins, and the protocol above: each policy gives the methods that raise here."""

    def __init__(self) -> None:
        self._pins: dict[object, set[int]] = {}
        self._holders: dict[int, set] = {}

    # -- what each policy gives (the protocol above); declared here so that the store
    # can name one type for any policy, which the compiled build calls directly
    def visit(self, layer: int) -> None:
        raise NotImplementedError

    def insert(self, slot: int, key=None, predicted: bool = False) -> None:
        raise NotImplementedError

    def touch(self, slot: int, key=None) -> None:
        raise NotImplementedError

    def demote(self, slot: int) -> None:
        raise NotImplementedError

    def remove(self, slot: int) -> None:
        raise NotImplementedError

    def has(self, slot: int) -> bool:
        raise NotImplementedError

    def victim(self, exclude=()) -> int | None:
        raise NotImplementedError

    def evictable(self, exclude=()) -> int:
        raise NotImplementedError

    def admits(self, key, slot: int, confidence: float) -> bool:
        raise NotImplementedError

    def ranking(self, slot_key) -> list[tuple]:
        raise NotImplementedError(f"the {type(self).__name__} policy keeps no ranking")

    def export(self) -> dict:
        raise NotImplementedError(f"the {type(self).__name__} policy keeps no statistics")

    def restore(self, state: dict) -> None:
        raise NotImplementedError(f"the {type(self).__name__} policy keeps no statistics")

    def check(self) -> None:
        raise NotImplementedError

    def pin(self, slot: int, holder) -> bool:
        """Pin ``slot`` for ``holder``; False if the holder already had it."""
        held = self._pins.setdefault(holder, set())
        if slot in held:
            return False
        held.add(slot)
        hs = self._holders.get(slot)
        if hs is None:
            self._holders[slot] = {holder}
            self._pinned(slot)
        else:
            hs.add(holder)
        return True

    def pin_all(self, slots, holder) -> None:
        """``pin`` each of ``slots`` for ``holder``: one lookup of the holder's set for a fetch."""
        if not slots:
            return                                  # (no empty pin set is kept: check_pins)
        held = self._pins.setdefault(holder, set())
        holders = self._holders
        first = []
        for slot in slots:
            if slot in held:
                continue
            held.add(slot)
            hs = holders.get(slot)
            if hs is None:
                holders[slot] = {holder}
                first.append(slot)
            else:
                hs.add(holder)
        if first:
            self._pinned_all(first)

    def insert_pinned(self, slot: int, key, predicted: bool, holder) -> None:
        """``insert`` then ``pin``: a miss or a prediction, pinned as it enters (a policy
        may do both in one step: every miss and prediction comes so)."""
        self.insert(slot, key, predicted)
        self.pin(slot, holder)

    def replace(self, slot: int, key, predicted: bool, holder) -> None:
        """``remove(slot)`` then ``insert_pinned``: the store evicted ``slot`` (the
        victim) and gives it to ``key`` at once."""
        self.remove(slot)
        self.insert_pinned(slot, key, predicted, holder)

    def victims(self, n: int, loading) -> tuple[list[int], int]:
        """Up to ``n`` victims, each ``remove``d as it is chosen, none in ``loading`` (a
        slot being read): ``victim``, or ``victim(exclude=loading)`` when its choice is
        loading, then ``remove``, ``n`` times or until there is none.  Returns (the
        slots in order, how many choices were loading).  The store evicts ahead so."""
        out: list[int] = []
        skips = 0
        victim, remove = self.victim, self.remove
        while len(out) < n:
            s = victim()
            if s is not None and s in loading:
                skips += 1
                s = victim(exclude=loading)
            if s is None:
                break
            remove(s)
            out.append(s)
        return out, skips

    def touch_all(self, slots, keys) -> None:
        """``touch`` each of ``slots`` (holding ``keys``), in order: a fetch's hits."""
        for slot, key in zip(slots, keys):
            self.touch(slot, key)

    def hear_all(self, fetches) -> None:
        """Each of ``fetches`` (layer, keys of that layer, their slots), in order: the
        layer's ``visit``, then the keys' touches.  A client's reported hits come so."""
        visit, touch_all = self.visit, self.touch_all
        for layer, keys, slots in fetches:
            visit(layer)
            if keys:
                touch_all(slots, keys)

    def release(self, holder) -> list[int]:
        """Drop every pin of ``holder``; returns the slots it held, sorted."""
        held = self._pins.pop(holder, set())
        holders, last = self._holders, []
        for slot in held:
            hs = holders[slot]
            hs.discard(holder)
            if not hs:
                del holders[slot]
                last.append(slot)
        if last:
            self._unpinned_all(last)
        return sorted(held)

    def release_some(self, holder, slots) -> int:
        """Drop ``holder``'s pins of those of ``slots`` it holds (a layer's, when its client
        is done with it); returns how many it dropped."""
        held = self._pins.get(holder)
        if not held:
            return 0
        holders, last, n = self._holders, [], 0
        for slot in slots:
            if slot not in held:
                continue
            held.discard(slot)
            n += 1
            hs = holders[slot]
            hs.discard(holder)
            if not hs:
                del holders[slot]
                last.append(slot)
        if not held:
            del self._pins[holder]                  # (no empty pin set is kept: check_pins)
        if last:
            self._unpinned_all(last)
        return n

    def _unpinned_all(self, slots) -> None:
        """``_unpinned`` for each of ``slots`` (a policy may do it at once)."""
        for slot in slots:
            self._unpinned(slot)

    def _pinned_all(self, slots) -> None:
        """``_pinned`` for each of ``slots`` (a policy may do it at once)."""
        for slot in slots:
            self._pinned(slot)

    def _unpinned(self, slot: int) -> None:
        """Hook: ``slot`` lost its last pin (a policy with an index re-files it)."""

    def _pinned(self, slot: int) -> None:
        """Hook: ``slot`` got its first pin."""

    def _forget_pins(self, slot: int) -> None:
        for holder in self._holders.pop(slot, ()):
            held = self._pins[holder]
            held.discard(slot)
            if not held:
                del self._pins[holder]

    def pinned(self, slot: int) -> bool:
        return slot in self._holders

    def held(self, holder) -> set[int]:
        return self._pins.get(holder, set())

    def pinned_count(self) -> int:
        return len(self._holders)

    def _unpinned_among(self, resident, exclude) -> int:
        """How many of ``resident`` (a sized container of slots) are neither pinned nor in
        ``exclude``.  O(pins + exclude): every pinned slot is resident (the store pins only
        slots it holds; the LRU and cycle policies' ``check`` asserts it)."""
        held = self._holders
        if not exclude:                     # (AutoPrefetch asks so at every fetch)
            return len(resident) - len(held)
        return len(resident) - len(held) - sum(1 for s in exclude if s in resident and s not in held)

    def check_pins(self) -> None:
        seen: dict[int, set] = {}
        for holder, held in self._pins.items():
            assert held, f"empty pin set kept for {holder!r}"
            for s in held:
                seen.setdefault(s, set()).add(holder)
        assert seen == self._holders, (seen, self._holders)
