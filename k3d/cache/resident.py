"""Which keys are resident, one byte per (layer, expert): the store's key map as rows.

``ResidentRows`` is part of the slot table (``SlotTable``, ``k3d.cache.slots``): the
table sets a key's byte when it assigns the key a slot (``_assign``) and clears it
when the key leaves (``_evict``, a failed read's ``complete``), the same three
places that change ``key_slot``.  It exists for the daemon's predictor (``CoPredictor.propose``), which
asks "which of layer L's experts are resident" at every fetch: ``row`` answers with
one copy of a layer's bytes instead of a dict lookup per expert (64 of them for a
64-expert model, the largest part of a proposal's cost before).

Invariant (``Store.check`` asserts it, ``check`` here): ``rows[layer][e] == 1``
exactly when ``(layer, e)`` is in the store's ``key_slot``; every other byte is 0.
Keys are ``(layer, expert)`` with both non-negative (the store's keys are).

``row`` returns ``bytes``, a snapshot: a caller may keep it (the predictor keeps a
proposal's mask until the layer's fetch resolves it) while the store moves on.

Thread: the server thread, as the store.
"""

from __future__ import annotations


class ResidentRows:
    __slots__ = ("rows", "key_slot")

    def __init__(self, key_slot: dict):
        self.rows: dict[int, bytearray] = {}    # layer -> one byte per expert, 1: resident
        self.key_slot = key_slot                # the store's map (for ``in``, and ``check``)

    def add(self, key) -> None:
        layer, e = key
        row = self.rows.get(layer)
        if row is None or len(row) <= e:        # (grown to the largest expert seen: rows stay short)
            row = self._grow(layer, e)
        row[e] = 1

    def discard(self, key) -> None:
        row = self.rows.get(key[0])
        if row is not None and key[1] < len(row):
            row[key[1]] = 0

    def _grow(self, layer: int, e: int) -> bytearray:
        row = self.rows.get(layer) or bytearray()
        row.extend(bytes(e + 1 - len(row)))
        self.rows[layer] = row
        return row

    def row(self, layer: int, n: int) -> bytes:
        """Layer ``layer``'s experts 0 .. n - 1: byte e is 1 where (layer, e) is resident."""
        row = self.rows.get(layer)
        if row is None:
            return bytes(n)
        if len(row) >= n:
            return bytes(row[:n])
        return bytes(row) + bytes(n - len(row))

    def __contains__(self, key) -> bool:
        return key in self.key_slot

    def check(self) -> None:
        ones = {(layer, e) for layer, row in self.rows.items() for e, b in enumerate(row) if b}
        assert ones == self.key_slot.keys(), (ones ^ self.key_slot.keys())


def residency(resident, layer: int, keys) -> bytes:
    """One byte per key of ``keys`` (layer ``layer``'s, expert order; 1: resident), in one
    call from ``ResidentRows`` (``row``), else one ``in`` per key of any container."""
    row = getattr(resident, "row", None)
    return row(layer, len(keys)) if row is not None else bytes(map(resident.__contains__, keys))
