"""Model-based test of the hit path: clients answer hits from the index, the daemon reuses slots later.

Hypothesis interleaves, on a small store (6 slots, 24 keys) with the real
``SharedIndex`` and ``IndexReader`` over a real memfd and ``Reuse``:
- a client answering a fetch itself: its lookups in the index, allowed only
  in the first half of its lease after its last request (as ``k3client`` does);
  each expert it gets is a view: (slot, key, what the slot held then);
- a client's request the daemon handles (a fetch of its own keys, a
  ``begin_token``): its reports first, then the op, then the reply; a fetch
  answered ``SlotsBusy`` leaves the client unsynced (``INF``) and it answers
  nothing itself until its next request, as ``k3client`` does;
- read completions, the clock moving on, the daemon settling (reclaim, make
  room), a client dying, a client attaching.

Invariant (the pin rule for the caller): every view a client holds (taken in
its current token, within ``lease`` of the request before it) still shows the
key it was taken for: the slot was neither rewritten nor given to another key.
And the store's own invariants (``Store.check``), plus: a slot waiting for
reuse is in neither the free list nor the index.
"""

from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from k3client.errors import CacheFull, SlotsBusy
from k3client.index import READY, IndexReader
from k3d.cache.policy import make
from k3d.cache.reuse import Reuse
from k3d.cache.store import Store
from k3d.memory.index import SharedIndex

SLOTS, LAYERS, EXPERTS, LEASE = 6, 4, 6, 10.0
BUSY = object()                             # a request answered SlotsBusy
keys_st = st.lists(st.integers(0, EXPERTS - 1), min_size=1, max_size=3, unique=True)


class HitPathMachine(RuleBasedStateMachine):
    @initialize(n=st.integers(1, 3))
    def setup(self, n):
        self.index = SharedIndex(LAYERS, EXPERTS)
        self.reader = IndexReader(self.index.fd, self.index.size)
        self.store = Store(SLOTS, policy=make("lru"), index=self.index, reuse=Reuse(), reserve=2)
        self.now = 0.0
        self.written = [0] * SLOTS          # times each slot was filled
        self.clients = {}                   # id -> {epoch, t_req, views, reports}
        self.next_id = 1
        for _ in range(n):
            self.attach()

    def teardown(self):
        self.reader.close()
        self.index.close()

    def attach(self):
        c = self.next_id
        self.next_id += 1
        self.clients[c] = {"epoch": 0, "t_req": self.now, "views": [], "reports": [], "busy": False}
        self.store.reuse.attach(c, self.now, LEASE)

    # -- the daemon handles one request of client c ---------------------------------
    def request(self, c, op):
        """As the loop does: a reply syncs the client, except ``SlotsBusy``'s, after which
        the client answers nothing itself until its next request (``busy``)."""
        cl, store = self.clients[c], self.store
        cl["t_req"] = self.now
        cl["busy"] = False
        store.reuse.waiting(c)
        for keys, seen in cl["reports"]:
            store.report((c, cl["epoch"]), keys, seen)
        cl["reports"] = []
        if op(cl) is BUSY:
            cl["busy"] = True
        else:
            store.reuse.replied(c, self.now)
        store.reclaim(self.now)
        store.make_room(self.now)

    @rule(data=st.data(), layer=st.integers(0, LAYERS - 1), experts=keys_st)
    def fetch_through_daemon(self, data, layer, experts):
        c = data.draw(st.sampled_from(sorted(self.clients)))
        keys = [(layer, e) for e in experts]

        def op(cl):
            try:
                plan = self.store.fetch((c, cl["epoch"]), keys, self.now)
            except CacheFull:
                return
            except SlotsBusy:
                return BUSY
            for s in plan.new_loads:        # reads finish before the reply (a parked fetch)
                self.complete(s)
            for key, s in zip(keys, plan.slots):
                if self.store.state[s] == "ready":
                    cl["views"].append((s, key, self.written[s], cl["t_req"]))
        self.request(c, op)

    @rule(data=st.data(), layer=st.integers(0, LAYERS - 1), experts=keys_st)
    def answer_here(self, data, layer, experts):
        c = data.draw(st.sampled_from(sorted(self.clients)))
        cl = self.clients[c]
        if cl["busy"] or self.now >= cl["t_req"] + LEASE / 2:
            return
        words = self.reader.lookup(layer, experts)
        if not all(w & 3 == READY for w in words):
            return
        slots = [w >> 2 for w in words]
        cl["reports"].append(([(layer, e) for e in experts], slots))
        for e, s in zip(experts, slots):
            cl["views"].append((s, (layer, e), self.written[s], cl["t_req"]))

    @rule(data=st.data())
    def begin_token(self, data):
        c = data.draw(st.sampled_from(sorted(self.clients)))

        def op(cl):
            self.store.end_epoch(c, (c, cl["epoch"]))
            self.store.reuse.new_token(c)
            cl["epoch"] += 1
            cl["views"] = []
        self.request(c, op)

    @rule()
    def finish_reads(self):
        for s in sorted(self.store.loads):
            self.complete(s)

    def complete(self, s):
        self.written[s] += 1
        self.store.complete(s, None)

    @rule(dt=st.sampled_from([0.5, 2.0, 6.0]))
    def tick(self, dt):
        self.now += dt
        self.store.reclaim(self.now)

    @precondition(lambda self: len(self.clients) > 1)
    @rule(data=st.data())
    def die(self, data):
        c = data.draw(st.sampled_from(sorted(self.clients)))
        cl = self.clients.pop(c)
        self.store.end_epoch(c, (c, cl["epoch"]))
        self.store.reuse.leave(c)
        self.store.reclaim(self.now)

    @precondition(lambda self: len(self.clients) < 4)
    @rule()
    def new_client(self):
        self.attach()

    # -- invariants ---------------------------------------------------------------
    @invariant()
    def views_hold_their_keys(self):
        for cl in self.clients.values():
            for s, key, written, t_req in cl["views"]:
                if self.now >= t_req + LEASE:
                    continue                    # the view's lease ended (the pin rule's bound)
                assert self.written[s] == written, f"slot {s} rewritten under a view of {key}"
                assert s in self.store.reuse.limbo or self.store.slot_key[s] == key, \
                    f"slot {s} free or given to {self.store.slot_key[s]} under a view of {key}"

    @invariant()
    def store_and_index_agree(self):
        self.store.check()
        for layer in range(LAYERS):
            words = self.reader.lookup(layer, list(range(EXPERTS)))
            for e, w in enumerate(words):
                s = self.store.key_slot.get((layer, e))
                if s is None:
                    assert w == 0
                else:
                    assert w >> 2 == s and w & 3 == (READY if self.store.state[s] == "ready" else 1)
        assert not self.store.reuse.limbo.keys() & set(self.store.free)


TestHitPath = HitPathMachine.TestCase
TestHitPath.settings = settings(max_examples=150, stateful_step_count=60, deadline=None,
                                suppress_health_check=[HealthCheck.too_slow])


def test_one_client_reuses_at_once_as_without_the_index():
    """One client, blocked in the request that evicts: its victims are reused at once,
    so the store picks the slots it would pick without the index."""
    plain = Store(2, policy=make("lru"))
    index = SharedIndex(1, 4)
    try:
        shared = Store(2, policy=make("lru"), index=index, reuse=Reuse(), reserve=1)
        shared.reuse.attach(1, 0.0, LEASE)
        for e in range(4):
            shared.reuse.waiting(1)
            for st_ in (plain, shared):
                plan = st_.fetch((1, e), [(0, e)], 0.0)
                st_.complete(plan.new_loads[0], None)
                st_.end_epoch(1, (1, e))
            shared.reuse.replied(1, 0.0)
            assert shared.slot_key == plain.slot_key and not shared.reuse.limbo
        assert shared.stats == plain.stats
    finally:
        index.close()


def two_readers(index) -> Store:
    """A 2-slot store with two hit-path clients attached, both slots filled by client 1's
    epoch 0 (ended: unpinned, and client 1 may read them from the index)."""
    store = Store(2, policy=make("lru"), index=index, reuse=Reuse())
    store.reuse.attach(1, 0.0, LEASE)
    store.reuse.attach(2, 0.0, LEASE)
    for e in (0, 1):
        store.reuse.waiting(1)
        store.complete(store.fetch((1, 0), [(0, e)], 0.0).new_loads[0], None)
        store.reuse.replied(1, 0.0)
    store.end_epoch(1, (1, 0))
    return store


def test_a_second_reader_delays_reuse_until_its_next_request():
    index = SharedIndex(1, 4)
    try:
        store = two_readers(index)
        r = store.reuse
        r.waiting(1)
        try:
            store.fetch((1, 1), [(0, 2)], 1.0)
            raise AssertionError("a slot client 2 may read was reused")
        except SlotsBusy:
            pass
        r.replied(1, 1.0)
        store.make_room(1.0)                  # evicts ahead: the victim waits for client 2
        assert len(r.limbo) >= 1 and store.reclaim(1.0) == 0
        r.waiting(2)
        r.replied(2, 1.5)                     # client 2's next request: it saw the eviction
        assert store.reclaim(1.5) == 0        # client 1 has not: its reply preceded the eviction
        r.waiting(1)
        r.replied(1, 1.6)
        assert store.reclaim(1.6) >= 1 and not r.limbo
    finally:
        index.close()


def test_reports_of_a_slot_since_given_away_or_loading_are_late():
    """A report whose key left the slot it was seen in, or whose slot is loading (no client
    saw it READY there), is a late hit: counted, not heard or pinned (no reader is attached
    here, so the slot is reused at once and its claim is moot)."""
    store = Store(2, policy=make("lru"))
    for e in (0, 1):
        store.complete(store.fetch((1, 0), [(0, e)], 0.0).new_loads[0], None)
    store.end_epoch(1, (1, 0))
    s0 = store.key_slot[(0, 0)]
    store.report((1, 1), [(0, 0)], [s0])                  # in time: a hit, pinned
    assert (store.stats.hits, store.stats.late_hits) == (1, 0) and s0 in store.policy.held((1, 1))
    store.end_epoch(1, (1, 1))
    plan = store.fetch((2, 0), [(0, 2)], 0.0)             # evicts one of them; its new key loads
    (s,) = plan.new_loads
    gone = (0, 0) if s == s0 else (0, 1)
    store.report((1, 2), [gone], [s])                     # seen before the eviction
    store.report((1, 2), [(0, 2)], [s])                   # names the loading key: never seen READY
    assert (store.stats.hits, store.stats.late_hits) == (3, 2)
    assert not store.policy.held((1, 2)) and store.policy.held((2, 0)) == {s}
    store.check()


def test_a_client_answered_slots_busy_keeps_no_slot_from_reuse():
    """Client 2's fetch is refused SlotsBusy: it retries and answers nothing itself until
    its next request, so the daemon leaves it unsynced (as while it waits) and client 1's
    fetch reuses a victim at once, where it would otherwise wait for client 2's retry."""
    index = SharedIndex(1, 4)
    try:
        store = two_readers(index)            # client 1 may read (0, 0) and (0, 1)
        r = store.reuse
        r.waiting(2)
        try:
            store.fetch((2, 0), [(0, 2)], 1.0)
            raise AssertionError("a slot client 1 may read was reused")
        except SlotsBusy:
            pass                              # the loop sends the reply and leaves client 2 unsynced
        r.waiting(1)
        plan = store.fetch((1, 1), [(0, 3)], 2.0)
        assert plan.new_loads and not r.limbo and plan.evictions == 1
    finally:
        index.close()
