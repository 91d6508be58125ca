"""Unit: the policy's one-call steps (``insert_pinned``, ``replace``, ``victims``) choose
what the steps they stand for choose, in any interleaving, for every policy."""

import random

import pytest

from k3d.cache.policy import make


class Twins:
    """The same requests to two policies: ``fused`` through the one-call steps, ``plain``
    through the steps they stand for (insert then pin; remove, insert, pin; a victim and
    its removal, one at a time, a loading one skipped as ``SlotTable._victim`` does)."""

    def __init__(self, name: str, layers: int):
        self.fused, self.plain = make(name, layers=layers), make(name, layers=layers)

    def both(self, op: str, *args):
        a, b = getattr(self.fused, op)(*args), getattr(self.plain, op)(*args)
        assert a == b, (op, args, a, b)
        return a

    def insert_pinned(self, slot, key, predicted, holder):
        self.fused.insert_pinned(slot, key, predicted, holder)
        self.plain.insert(slot, key, predicted)
        self.plain.pin(slot, holder)

    def replace(self, slot, key, predicted, holder):
        self.fused.replace(slot, key, predicted, holder)
        self.plain.remove(slot)
        self.plain.insert(slot, key, predicted)
        self.plain.pin(slot, holder)

    def victims(self, n, loading):
        got = self.fused.victims(n, loading)
        out, skips = [], 0
        while len(out) < n:
            s = self.plain.victim()
            if s is not None and s in loading:
                skips += 1
                s = self.plain.victim(exclude=loading)
            if s is None:
                break
            self.plain.remove(s)
            out.append(s)
        assert got == (out, skips)
        return out


@pytest.mark.parametrize("name", ["cycle", "lru"])
@pytest.mark.parametrize("seed", range(4))
def test_one_call_steps_choose_what_their_steps_choose(name, seed):
    rng = random.Random(seed)
    layers, experts, slots = 6, 14, 36
    t = Twins(name, layers)
    key_of, free, token, loading = {}, list(range(slots)), 0, set()
    for step in range(1200):
        layer = step % layers
        if layer == 0:
            t.both("release", ("c", token))           # a token's end: every pin goes
            token += 1
        t.both("visit", layer)
        resident = {k: s for s, k in key_of.items()}
        hits = []
        for key in [(layer, e) for e in rng.sample(range(experts), 3)]:
            s = resident.get(key)
            if s is not None:
                t.both("pin", s, ("c", token))
                hits.append((s, key))
                continue
            holder = ("c", token) if rng.random() < 0.7 else ("predict", 0)
            if free:
                s = free.pop()
                t.insert_pinned(s, key, holder[0] == "predict", holder)
            else:
                s = t.both("victim")
                if s is None or s in loading:
                    continue
                del key_of[s]
                t.replace(s, key, holder[0] == "predict", holder)
            key_of[s] = key
            if rng.random() < 0.2:
                loading.add(s)                       # its read is still going
        if hits:
            t.both("touch_all", [s for s, _ in hits], [k for _, k in hits])
        loading = {s for s in loading if rng.random() < 0.6}
        if rng.random() < 0.3:                        # evictions ahead (make_room)
            for s in t.victims(rng.randrange(1, 6), loading):
                del key_of[s]
                free.append(s)
        if rng.random() < 0.2:
            t.both("release", ("predict", 0))
        if step % 101 == 0:
            t.fused.check()
            t.plain.check()
    t.fused.check()
    t.plain.check()
    assert t.fused.pinned_count() == t.plain.pinned_count()
