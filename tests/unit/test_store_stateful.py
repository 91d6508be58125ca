"""Stateful property test of the cache invariants: hypothesis drives ``k3d.cache.store.Store``.

Pure (no sockets, no threads): random interleavings of fetch, predict,
begin_token, a layer's release (``release_layers``), client death, and read completion (ok or failed) on a small
store (6 slots, 24 keys), with and without a pin quota.  The model keeps what
the server keeps: the parked fetches (``Pending``) and the rule that a fetch
is answered only once every one of its slots is READY and still holds its
key (``k3d.cache.parked.checked_slots``); a failed read answers its waiters
with an error.

Invariants, checked after every step (plus ``store.check()``):
- a pinned slot is never evicted or rewritten: every pin the model expects is
  held in the policy, on a non-free slot still holding the pinned key;
- a new read never starts in a slot that was pinned;
- every key maps to at most one slot (and back), and the residency rows
  (``Store.resident``, the predictor's) name exactly the mapped keys;
- a reply never names a loading slot, and a still-pinned fetch is always
  answered with its own keys;
- counters add up: hits + misses = fetched keys, misses = urgent loads,
  errors = failed reads, evictions = loads started in READY slots, and the
  gauges match the slot states;
- a refused fetch (cache full, quota) changes nothing.
"""

from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from helpers import policy_state
from k3client.errors import CacheFull, QuotaExceeded
from k3d.cache.policy import make
from k3d.cache.predictions import PREDICT
from k3d.cache.slots import FREE, LOADING, READY
from k3d.cache.store import Store
from k3d.config import Live

SLOTS, LAYERS, EXPERTS, CLIENTS = 6, 4, 6, 3
keys_st = st.lists(st.tuples(st.integers(0, LAYERS - 1), st.integers(0, EXPERTS - 1)),
                   min_size=1, max_size=4, unique=True)


class StoreMachine(RuleBasedStateMachine):
    quota = 0
    policy_name = "lru"

    @initialize()
    def setup(self):
        self.store = Store(SLOTS, Live(pin_quota=self.quota), policy=make(self.policy_name))
        self.next_id = CLIENTS + 1
        self.live = list(range(1, CLIENTS + 1))        # index -> client id
        self.epoch = {c: 0 for c in self.live}
        self.pins: dict[tuple, dict[int, tuple]] = {}  # holder -> {slot: key} the model expects
        self.pending: list[dict] = []
        self.n = dict(fetches=0, keys=0, misses=0, errors=0, evictions=0, prefetched=0,
                      replies=0, error_replies=0)

    # -- helpers ---------------------------------------------------------------
    def holder(self, c):
        return (c, self.epoch[c])

    def snapshot(self):
        s, pol = self.store, self.store.policy
        holders = [h for c in self.live for h in (self.holder(c), (PREDICT, c))]
        return (tuple(s.state), tuple(s.slot_key), dict(s.key_slot), tuple(s.free), tuple(sorted(s.loads)),
                policy_state(pol, s.slot_key), {h: set(pol.held(h)) for h in holders},
                [pol.pinned(slot) for slot in range(SLOTS)],
                dict(s.book.predicted_by), {c: set(v) for c, v in s.book.predictions.items()})

    def pinned_now(self):
        return {s for s in range(SLOTS) if self.store.policy.pinned(s)}

    def reply(self, p):
        """The server's rule: answer with the slots only if all are READY with their keys."""
        st_ = self.store
        ok = all(st_.state[s] == READY and st_.slot_key[s] == k for k, s in zip(p["keys"], p["slots"]))
        if p["holder"] in self.pins:       # still pinned: must be answered with its own keys
            assert ok, (p, st_.state, st_.slot_key)
        if ok:
            for s in p["slots"]:
                assert st_.state[s] != LOADING
            self.n["replies"] += 1
        else:
            self.n["error_replies"] += 1

    def end(self, c, dead):
        h = self.holder(c)
        released, _ = self.store.end_epoch(c, h)
        assert released == len(self.pins.pop(h, {}))
        self.pins.pop((PREDICT, c), None)       # predictions are held until the next token
        if dead:
            self.pending = [p for p in self.pending if p["holder"][0] != c]

    # -- rules -------------------------------------------------------------------
    @rule(i=st.integers(0, CLIENTS - 1), keys=keys_st)
    def fetch(self, i, keys):
        c = self.live[i]
        h = self.holder(c)
        before, pinned, states = self.snapshot(), self.pinned_now(), list(self.store.state)
        try:
            plan = self.store.fetch(h, keys)
        except (CacheFull, QuotaExceeded) as e:
            assert self.snapshot() == before, f"refused fetch changed the store: {e}"
            if isinstance(e, QuotaExceeded):
                assert self.quota and len(self.store.policy.held(h) | {
                    self.store.key_slot[k] for k in keys if k in self.store.key_slot}) + sum(
                    k not in self.store.key_slot for k in keys) > self.quota
            return
        assert len(plan.slots) == len(keys)
        for s in plan.new_loads:
            assert s not in pinned, f"new read started in pinned slot {s}"
        self.n["evictions"] += sum(states[s] == READY for s in plan.new_loads)
        self.n["fetches"] += 1
        self.n["keys"] += len(keys)
        self.n["misses"] += len(plan.new_loads)
        assert plan.misses == len(plan.new_loads)
        mine = self.pins.setdefault(h, {})
        for k, s in zip(keys, plan.slots):
            assert self.store.slot_key[s] == k
            mine[s] = k
        if self.quota:
            assert len(self.store.policy.held(h)) <= self.quota
        p = {"holder": h, "keys": list(keys), "slots": list(plan.slots), "waiting": set(plan.waiting)}
        assert p["waiting"] == {s for s in plan.slots if self.store.state[s] == LOADING}
        if p["waiting"]:
            self.pending.append(p)
        else:
            self.reply(p)

    @rule(i=st.integers(0, CLIENTS - 1), keys=keys_st)
    def predict(self, i, keys):
        c = self.live[i]
        pinned, states = self.pinned_now(), list(self.store.state)
        started = self.store.predict(c, keys)
        held = self.pins.setdefault((PREDICT, c), {})
        for s in started:
            assert s not in pinned and self.store.state[s] == LOADING
            held[s] = self.store.slot_key[s]
        if not held:
            del self.pins[(PREDICT, c)]
        self.n["evictions"] += sum(states[s] == READY for s in started)
        self.n["prefetched"] += len(started)

    @rule(i=st.integers(0, CLIENTS - 1))
    def begin_token(self, i):
        c = self.live[i]
        self.end(c, dead=False)
        self.epoch[c] += 1

    @rule(i=st.integers(0, CLIENTS - 1), layer=st.integers(0, LAYERS - 1))
    def release_layer(self, i, layer):
        """The client is done with ``layer`` (its fetches of it answered): its pins of the
        layer go, and its used predictions' of it; outstanding predictions stay."""
        c = self.live[i]
        h = self.holder(c)
        if any(p["holder"] == h and any(k[0] == layer for k in p["keys"]) for p in self.pending):
            return                                  # (a client releases only what it has read)
        predicted = self.store.book.predicted_by
        gone = 0
        for who, used_only in ((h, False), ((PREDICT, c), True)):
            held = self.pins.get(who, {})
            for slot in [s for s, k in held.items() if k[0] == layer and not (used_only and s in predicted)]:
                del held[slot]
                gone += 1
            if who in self.pins and not held:
                del self.pins[who]
        assert self.store.release_layers(h, {layer}) == gone

    @rule(i=st.integers(0, CLIENTS - 1))
    def client_dies(self, i):
        c = self.live[i]
        self.end(c, dead=True)
        del self.epoch[c]
        self.live[i] = self.next_id
        self.epoch[self.next_id] = 0
        self.next_id += 1

    @precondition(lambda self: self.store.loads)
    @rule(data=st.data(), ok=st.booleans())
    def read_completes(self, data, ok):
        s = data.draw(st.sampled_from(sorted(self.store.loads)))
        key = self.store.loads[s].key
        self.store.complete(s, None if ok else "injected read error")
        if not ok:
            self.n["errors"] += 1
            assert self.store.state[s] == FREE and key not in self.store.key_slot
            for held in self.pins.values():   # a failed read drops the slot and its pins
                held.pop(s, None)
            for h in [h for h, held in self.pins.items() if not held]:
                del self.pins[h]
        still = []
        for p in self.pending:
            if s not in p["waiting"]:
                still.append(p)
                continue
            if not ok:
                self.n["error_replies"] += 1      # every waiter gets the read error
                continue
            p["waiting"].discard(s)
            if p["waiting"]:
                still.append(p)
            else:
                self.reply(p)
        self.pending = still

    # -- invariants ------------------------------------------------------------------
    @invariant()
    def invariants_hold(self):
        """All four checks after every step, registered as one invariant: hypothesis's own
        bookkeeping per registered invariant costs more than these checks do."""
        self.store_checks()
        self.pinned_slots_never_evicted_or_rewritten()
        self.keys_map_to_one_slot()
        self.counters_add_up()

    def store_checks(self):
        self.store.check()

    def pinned_slots_never_evicted_or_rewritten(self):
        pol = self.store.policy
        for h, held in self.pins.items():
            assert pol.held(h) == set(held), (h, pol.held(h), held)
            for s, k in held.items():
                assert self.store.state[s] != FREE and self.store.slot_key[s] == k
        assert pol.pinned_count() == len({s for held in self.pins.values() for s in held})

    def keys_map_to_one_slot(self):
        owned = [k for k in self.store.slot_key if k is not None]
        assert len(owned) == len(set(owned)) == len(self.store.key_slot)

    def counters_add_up(self):
        st_, n = self.store.stats, self.n
        assert st_.fetches == n["fetches"]
        assert st_.hits + st_.misses == n["keys"]
        assert st_.misses == n["misses"]
        assert st_.errors == n["errors"]
        assert st_.evictions == n["evictions"]
        assert st_.prefetched == n["prefetched"]
        assert st_.waited <= st_.hits and st_.prefetch_hits <= st_.prefetched
        g = self.store.gauges()
        assert g["used"] + g["free"] == SLOTS
        assert g["loading"] == self.store.state.count(LOADING)
        assert g["free"] == self.store.state.count(FREE)
        for p in self.pending:                # a parked fetch waits only on loading slots
            assert all(self.store.state[s] == LOADING for s in p["waiting"])


class StoreWithQuota(StoreMachine):
    quota = 3


class StoreCycle(StoreMachine):
    policy_name = "cycle"


# Budget (the unit layer runs in under 15 s): at most 70 x 50 steps for the plain machine,
# 60 x 50 for the cycle-policy one and 40 x 50 for the quota one (hypothesis's own
# bookkeeping, ~0.8 ms a step, is the cost).  Measured against ten bugs
# injected into the store (bench/README.md, "the stateful test's budget"): the unit layer
# still catches every one; the rarest for these machines (the capacity check counting the
# fetch's own hits as evictable) is also pinned down by test_store.py.  A failure found
# once is replayed from the example database (.hypothesis/) on later runs.
_common = dict(stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestStore = StoreMachine.TestCase
TestStore.settings = settings(max_examples=70, **_common)
TestStoreWithQuota = StoreWithQuota.TestCase
TestStoreWithQuota.settings = settings(max_examples=40, **_common)
TestStoreCycle = StoreCycle.TestCase
TestStoreCycle.settings = settings(max_examples=60, **_common)
