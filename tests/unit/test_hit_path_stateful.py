"""Model-based test of the hit path: clients answer hits from the index, the daemon reuses slots later.

Hypothesis interleaves, on a small store (4 slots, 8 keys: 2 layers x 4 experts) with the real
``SharedIndex``, the real client half (``k3client.hits.LocalHits``, one per
client, over the same memfd) and the real ``Reuse``, what clients really do and
what the daemon does, one message at a time:

- a client answers a fetch itself (``LocalHits.answer``: only while its window
  is open); each expert it gets is a view: (slot, key, what the slot held then);
- a client sends a request (a fetch, a ``begin_token``): its window shuts, its
  reports go with it, and it waits; it may **give up** on it (a ``Timeout``,
  Ctrl-C), and the daemon still handles it and replies later (a stale reply);
- a client reads a reply: the one it waits for opens its window (an error keeps
  it shut), a stale one is skipped; a fetch's slots become views;
- a fetch may ask ``as_ready`` (``Client.fetch_iter``): the daemon sends its keys
  ready at once, then each read as it finishes, as parts before the final reply;
  a part's slots become views at once but the window stays shut until the final
  reply, and the client may give up mid-stream (leaving its loop, Ctrl-C, a
  timeout) with the parts' views still held;
- a client's lease thread sends its reports and ``seen`` (``LocalHits.sync``) on
  its request socket (also between the parts of a stream: the client's thread
  holds the socket only while it waits for one), or fails to (``unsend``) while
  the client's thread answers a fetch, and a client flushes reports (``hits``)
  without waiting;
- the daemon handles a client's next message in order, as ``serve/loop.py``
  does: ``waiting`` for a request, then its reports, then the op; a fetch with
  misses is parked until its reads finish, then answered (re-pinned if the
  client has begun a token since);
- a client **holds** its views for as long as hypothesis likes: nothing but its
  own ``begin_token``, or its release of their layer, ends them (there is no
  clock: no lease bound);
- a client **releases** a layer (``LocalHits.release``, protocol 6 ``done``), also
  between the parts of a stream (one of that layer then ends, as
  ``Client.release_layer`` ends it): its next message says so, after that
  message's reports; the daemon unpins the layer's slots and drops its claims of them.  The views of that layer it took
  before are set aside: it keeps "reading" them (``released``), as a client
  that breaks its obligation would, and nothing is promised for them; a fetch of
  the layer after the release is a new view, promised again;
- read completions and failed reads (their entries cleared, their fetches
  answered ``ReadFailed``), the daemon settling (reclaim, make room), a client
  dying, a client attaching, the daemon restarting (every client re-attaches;
  views of the old arena keep the old mapping, which nobody writes);
- a misbehaving client sending reports of slots it never read and ``seen``
  counts it never saw, and a client releasing layers whose views it still reads
  (applied at once, out of turn: its own views of them are set aside).

Invariant (the guarantee): every view an honest client holds in its current
token, of a layer it has not released since, shows the key it was taken for: the
slot was neither rewritten nor given to another key.  So a rewritten byte can be
seen only through a view its client released (``released``), never through
another client's view, released or not.  An honest client's ``seen`` is never refused (it would hold reuse
back).  And the store's own invariants (``Store.check``: the count clients read
is the count ``Reuse`` keeps), plus: a slot waiting for reuse is in neither the
free list nor the index.

The scenarios below the machine replay, step by step, the issue's reproductions
and the holes a review found in the first version of this protocol (a failed
read's count, slots the daemon answered under a quota, a fetch given up on and
answered in the next token, an interrupt between taking reports and sending them).
"""

from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from k3client.errors import CacheFull, QuotaExceeded, SlotsBusy
from k3client.hits import LocalHits
from k3client.index import READY, IndexReader
from k3d.cache.policy import make
from k3d.cache.reuse import Reuse
from k3d.cache.store import Store
from k3d.memory.index import SharedIndex

SLOTS, LAYERS, EXPERTS = 4, 2, 4
keys_st = st.lists(st.integers(0, EXPERTS - 1), min_size=1, max_size=2, unique=True)


class Client:
    def __init__(self, cid: int, index: SharedIndex, quota: int):
        self.id = cid
        self.hits = LocalHits(index.fd, index.size, None, quota)
        self.epoch = 0               # the daemon's epoch for it (its holder)
        self.outbox: list = []       # messages on its request socket, in order
        self.inbox: list = []        # replies: (rid, ok, slots or None, keys)
        self.waiting = None          # the rid it waits for
        self.streaming = False       # ... and it is an as_ready fetch (parts come first)
        self.stream_layer = None     # ... of this layer
        self.rid = 0
        self.views: list = []        # (slot, key, written)
        self.released: list = []     # views of layers it released this token, still read (nothing promised)


class HitPathMachine(RuleBasedStateMachine):
    POLICY = "lru"
    @initialize(n=st.integers(1, 3), quota=st.sampled_from([0, 0, 4]))
    def setup(self, n, quota):
        self.quota = quota
        self.clients: dict[int, Client] = {}
        self.next_id = 1
        self.bogus = None
        self._daemon()
        for _ in range(n):
            self.attach()

    def _daemon(self):
        self.index = SharedIndex(LAYERS, EXPERTS)
        self.reader = IndexReader(self.index.fd, self.index.size)
        self.store = Store(SLOTS, policy=make(self.POLICY, layers=LAYERS), index=self.index, reuse=Reuse(), reserve=2)
        self.store.live.pin_quota = self.quota
        self.written = [0] * SLOTS          # times each slot was filled
        self.parked: list = []              # (client id, rid, holder, keys, slots, sent: set or None)
        self.old = []                       # indexes of restarted daemons (their arenas stay mapped)

    def teardown(self):
        for c in self.clients.values():
            c.hits.close()
        self.reader.close()
        self.index.close()
        for index, reader in self.old:
            reader.close()
            index.close()

    def attach(self):
        c = Client(self.next_id, self.index, self.quota)
        self.next_id += 1
        self.clients[c.id] = c
        self.store.reuse.attach(c.id)
        return c

    def pick(self, data, cond=lambda c: True):
        ids = sorted(i for i, c in self.clients.items() if cond(c))
        return self.clients[data.draw(st.sampled_from(ids))] if ids else None

    # -- the client side --------------------------------------------------------------
    @rule(data=st.data(), layer=st.integers(0, LAYERS - 1), experts=keys_st)
    def answer_here(self, data, layer, experts):
        self.answer(self.pick(data), layer, experts)

    def answer(self, c, layer, experts):
        slots = c.hits.answer(layer, experts)
        if slots is not None:
            c.views += [(s, (layer, e), self.written[s]) for e, s in zip(experts, slots)]

    def send(self, c, op, **fields):
        c.hits.open = False
        c.rid += 1
        taken = c.hits.take()
        c.outbox.append({"op": op, "rid": c.rid, "hits": taken.get("hits", []), "done": taken.get("done", []),
                         **fields})
        c.hits.sent()
        c.waiting = c.rid
        c.streaming = bool(fields.get("as_ready"))
        c.stream_layer = fields["keys"][0][0] if c.streaming else None

    @rule(data=st.data(), layer=st.integers(0, LAYERS - 1), experts=keys_st, as_ready=st.booleans())
    def send_fetch(self, data, layer, experts, as_ready):
        c = self.pick(data, lambda c: c.waiting is None)
        if c is not None:
            self.send(c, "fetch", keys=[(layer, e) for e in experts], as_ready=as_ready)

    @rule(data=st.data())
    def send_begin_token(self, data):
        c = self.pick(data, lambda c: c.waiting is None)
        if c is not None:
            self.begin(c)

    def begin(self, c):
        c.views = []                        # the caller's views of the token end here
        c.released = []
        self.send(c, "begin_token")
        c.hits.new_token()                  # (as Client._call: after the message is taken)

    @rule(data=st.data(), layer=st.integers(0, LAYERS - 1))
    def release_layer(self, data, layer):
        """The client is done with ``layer`` (its compute ran): ``Client.release_layer``."""
        c = self.pick(data, lambda c: c.waiting is None or c.streaming)
        if c is not None:
            self.release_layer_of(c, layer)

    def release_layer_of(self, c, layer):
        if c.streaming and c.stream_layer == layer:
            # Client.release_layer ends a stream of the layer: no part after it is read
            # (the window stays shut until the next request's reply)
            c.waiting, c.streaming = None, False
        c.hits.release(layer)
        c.released += [v for v in c.views if v[1][0] == layer]
        c.views = [v for v in c.views if v[1][0] != layer]

    @rule(data=st.data())
    def give_up(self, data):
        """A Timeout or KeyboardInterrupt while it waits: the request goes on in the daemon."""
        c = self.pick(data, lambda c: c.waiting is not None)
        if c is not None:
            self.interrupt(c)

    def interrupt(self, c):
        c.waiting = None
        c.hits.failed()

    @rule(data=st.data())
    def read_reply(self, data):
        c = self.pick(data, lambda c: c.inbox)
        if c is not None:
            self.receive(c)

    def receive(self, c):
        rid, ok, slots, keys = c.inbox.pop(0)
        if rid != c.waiting:
            return                          # a late reply to a request it gave up on
        if ok == "part":                    # yielded now; the window stays shut (stream.py)
            c.views += [(s, k, self.written[s]) for k, s in zip(keys, slots)]
            return
        c.waiting = None
        c.streaming = False
        if not ok:
            c.hits.failed()
            return
        c.hits.open = True
        if slots is not None:
            c.hits.held_by_daemon(slots, keys[0][0])    # (k3client's fetch: they count toward its quota)
            c.views += [(s, k, self.written[s]) for k, s in zip(keys, slots)]

    @rule(data=st.data())
    def lease_sync(self, data):
        """The lease thread: while the client's thread is not in a request, or between
        the parts of a stream (it waits for one part at a time, holding the socket)."""
        c = self.pick(data, lambda c: c.waiting is None or c.streaming)
        if c is not None:
            self.sync(c)

    def sync(self, c):
        fields = c.hits.sync()
        if fields:
            c.outbox.append({"op": "hits", **fields})
            c.hits.sent()

    @rule(data=st.data(), layer=st.integers(0, LAYERS - 1), experts=keys_st, lookup=st.booleans())
    def lease_send_fails(self, data, layer, experts, lookup):
        """The lease thread takes the reports and releases, its send fails (a closing
        socket: ``unsend``); the client's thread may answer a fetch meanwhile."""
        c = self.pick(data, lambda c: c.waiting is None or c.streaming)
        if c is not None:
            c.hits.sync()
            if lookup:
                self.answer(c, layer, experts)
            c.hits.unsend()

    @rule(data=st.data())
    def flush_reports(self, data):
        c = self.pick(data, lambda c: c.hits.reports)
        if c is not None:
            c.outbox.append({"op": "hits", **c.hits.take()})
            c.hits.sent()

    # -- the daemon side --------------------------------------------------------------
    def reply(self, c, rid, ok, slots=None, keys=None):
        c.inbox.append((rid, ok, slots, keys))
        self.store.reuse.replied(c.id, rid, ok)

    def part(self, c, entry):
        """parked.py's part: the slots READY since the last, unless the client has moved on
        to its next token; not a reply to the request (``reuse`` is not told)."""
        cid, rid, holder, keys, slots, sent = entry
        if sent is None or (c.id, c.epoch) != holder:
            return
        new = [(k, s) for k, s in zip(keys, slots) if self.store.state[s] == "ready" and s not in sent]
        if new:
            sent.update(s for _, s in new)
            c.inbox.append((rid, "part", [s for _, s in new], [k for k, _ in new]))

    def report(self, c, reports):
        if reports:
            self.store.report_all((c.id, c.epoch), reports, quota=self.quota)

    @rule(data=st.data())
    def daemon_handles(self, data):
        c = self.pick(data, lambda c: c.outbox)
        if c is not None:
            self.handle(c)

    def handle(self, c):
        msg = c.outbox.pop(0)
        store = self.store
        if msg["op"] == "hits":
            self.report(c, _wire(msg.get("hits", [])))
            if msg.get("done"):
                store.release_layers((c.id, c.epoch), set(msg["done"]))
            if "seen" in msg:
                assert store.reuse.seen(c.id, msg["seen"])
        else:
            store.reuse.waiting(c.id, msg["rid"])
            self.report(c, _wire(msg["hits"]))
            if msg.get("done") and msg["op"] != "begin_token":     # (ignored there: every pin goes)
                store.release_layers((c.id, c.epoch), set(msg["done"]))
            if msg["op"] == "begin_token":
                store.end_epoch(c.id, (c.id, c.epoch))
                store.reuse.new_token(c.id)
                c.epoch += 1
                self.reply(c, msg["rid"], True)
            else:
                keys = msg["keys"]
                try:
                    plan = store.fetch((c.id, c.epoch), keys)
                except (CacheFull, SlotsBusy, QuotaExceeded):
                    self.reply(c, msg["rid"], False)
                else:
                    if plan.new_loads or any(store.state[s] != "ready" for s in plan.slots):
                        entry = (c.id, msg["rid"], (c.id, c.epoch), keys, plan.slots,
                                 set() if msg.get("as_ready") else None)
                        self.parked.append(entry)
                        self.part(c, entry)
                    else:
                        self.reply(c, msg["rid"], True, plan.slots, keys)
        self.settle()

    def settle(self):
        self.store.reclaim(0.0)
        self.store.make_room(0.0)

    @rule(data=st.data())
    def fail_a_read(self, data):
        """A read fails (an I/O error, a changed file, the origin): its fetches get ``ReadFailed``."""
        if self.store.loads:
            self.fail_read(data.draw(st.sampled_from(sorted(self.store.loads))))

    def fail_read(self, s):
        self.store.complete(s, "EIO")
        for p in [p for p in self.parked if s in p[4]]:
            self.parked.remove(p)
            self.reply(self.clients[p[0]], p[1], False)
        self.settle()

    @rule()
    def finish_reads(self):
        for s in sorted(self.store.loads):
            self.written[s] += 1
            self.store.complete(s, None)
        self.answer_parked()

    @rule(data=st.data())
    def finish_one_read(self, data):
        """One read finishes (a stream waiting on others gets a part)."""
        if self.store.loads:
            s = data.draw(st.sampled_from(sorted(self.store.loads)))
            self.written[s] += 1
            self.store.complete(s, None)
            self.answer_parked()

    def answer_parked(self):
        for p in list(self.parked):
            cid, rid, holder, keys, slots, _ = p
            c = self.clients[cid]
            if all(self.store.state[s] == "ready" for s in slots):
                self.parked.remove(p)
                ok = True
                if (c.id, c.epoch) != holder:            # parked.py: pin for the token it reads in
                    try:
                        if not self.store.reuse.awaited(c.id, rid):
                            raise QuotaExceeded("given up on")
                        self.store.repin((c.id, c.epoch), slots)
                    except QuotaExceeded:
                        ok = False
                self.reply(c, rid, ok, slots if ok else None, keys)
            else:
                self.part(c, p)
        self.settle()

    @precondition(lambda self: len(self.clients) > 1)
    @rule(data=st.data())
    def die(self, data):
        """The process exits (or stops heartbeating): its session and all it held go."""
        c = self.pick(data)
        del self.clients[c.id]
        self.store.end_epoch(c.id, (c.id, c.epoch))
        self.store.reuse.leave(c.id)
        self.parked = [p for p in self.parked if p[0] != c.id]
        c.hits.close()
        self.settle()

    @precondition(lambda self: len(self.clients) < 4)
    @rule()
    def new_client(self):
        self.attach()

    @rule()
    def restart(self):
        """The daemon restarts; every client re-attaches (a new session, its window open
        after hello).  Views taken before keep the old arena's mapping, unchanged."""
        old = list(self.clients.values())
        self.old.append((self.index, self.reader))
        self._daemon()
        self.clients = {}
        for c in old:
            c.hits.close()
            self.attach()

    @rule(data=st.data(), layer=st.integers(0, LAYERS - 1), experts=keys_st,
          slots=st.lists(st.integers(0, SLOTS - 1), min_size=3, max_size=3), seen=st.integers(0, 40))
    def bogus_reports(self, data, layer, experts, slots, seen):
        """A misbehaving client reports slots it never read and a count it never saw."""
        if self.bogus is None or self.bogus not in self.store.reuse.viewers:
            self.bogus = self.next_id
            self.next_id += 1
            self.store.reuse.attach(self.bogus)
        self.store.report_all((self.bogus, 0), [([(layer, e) for e in experts], slots[:len(experts)])],
                              quota=self.quota)
        self.store.reuse.seen(self.bogus, seen)
        self.store.reuse.seen(self.bogus, self.store.reuse.retired)   # (else it only holds reuse back)
        self.settle()

    @rule(data=st.data(), layers=st.sets(st.integers(0, LAYERS - 1), min_size=1))
    def dishonest_release(self, data, layers):
        """A client releases layers whatever it reads (``done`` on its next message, at
        once here): only its own pins and claims may go, never what others' views need."""
        c = self.pick(data, lambda c: c.waiting is None)
        if c is None:
            return
        self.store.release_layers((c.id, c.epoch), layers)
        c.released += [v for v in c.views if v[1][0] in layers]
        c.views = [v for v in c.views if v[1][0] not in layers]
        self.settle()

    # -- invariants ---------------------------------------------------------------
    @invariant()
    def views_hold_their_keys(self):
        for c in self.clients.values():
            for s, key, written in c.views:
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


def _wire(reports):
    """``LocalHits``'s ``[layer, experts, slots]`` reports as ``(keys, slots)``, as ``wire.hits`` makes them."""
    return [([(layer, e) for e in experts], slots) for layer, experts, slots in reports]


TestHitPath = HitPathMachine.TestCase
TestHitPath.settings = settings(max_examples=200, stateful_step_count=80, deadline=None,
                                suppress_health_check=[HealthCheck.too_slow])


class CycleHitPathMachine(HitPathMachine):
    """The same interleavings under the default policy (the model ran under LRU only).
    Its arena is small enough that every layer is scored before a released slot is
    pinned again, so ``filing``'s late filing itself is driven by
    ``test_policy_cycle.py``'s seeded test, not here."""
    POLICY = "cycle"


TestCycleHitPath = CycleHitPathMachine.TestCase
TestCycleHitPath.settings = TestHitPath.settings


def test_one_client_reuses_at_once_as_without_the_index():
    """One client, blocked in the request that evicts: its victims are reused at once,
    so the store picks the slots it would pick without the index."""
    plain = Store(2, policy=make("lru"))
    index = SharedIndex(1, 4)
    try:
        shared = Store(2, policy=make("lru"), index=index, reuse=Reuse(), reserve=1)
        shared.reuse.attach(1)
        for e in range(4):
            shared.reuse.waiting(1, e)
            for st_ in (plain, shared):
                plan = st_.fetch((1, e), [(0, e)], 0.0)
                st_.complete(plan.new_loads[0], None)
                st_.end_epoch(1, (1, e))
            shared.reuse.replied(1, e, ok=True)
            assert shared.slot_key == plain.slot_key and not shared.reuse.limbo
        assert shared.stats == plain.stats
    finally:
        index.close()


def two_readers(index) -> Store:
    """A 2-slot store with two hit-path clients attached, both slots filled by client 1's
    epoch 0 (ended: unpinned, and client 1 may read them from the index)."""
    store = Store(2, policy=make("lru"), index=index, reuse=Reuse())
    store.reuse.attach(1)
    store.reuse.attach(2)
    for e in (0, 1):
        store.reuse.waiting(1, e)
        store.complete(store.fetch((1, 0), [(0, e)], 0.0).new_loads[0], None)
        store.reuse.replied(1, e, ok=True)
    store.end_epoch(1, (1, 0))
    return store


def test_a_second_reader_delays_reuse_until_its_next_message():
    index = SharedIndex(1, 4)
    try:
        store = two_readers(index)
        r = store.reuse
        r.waiting(1, 10)
        try:
            store.fetch((1, 1), [(0, 2)], 1.0)
            raise AssertionError("a slot client 2 may read was reused")
        except SlotsBusy:
            pass
        r.replied(1, 10, ok=False)
        store.make_room(1.0)                  # evicts ahead: the victim waits for client 2
        assert len(r.limbo) >= 1 and store.reclaim(1.0) == 0
        r.waiting(2, 1)
        r.replied(2, 1, ok=True)              # client 2's next request: it saw the eviction
        assert store.reclaim(1.5) >= 1 and not r.limbo   # (client 1's failed request keeps it shut)
    finally:
        index.close()


def test_a_late_reply_to_a_request_given_up_on_does_not_move_the_sync_point():
    """Client 1 gives up on request 1 (a Timeout) and sends request 2, whose reply opens
    its window; request 1's reply, sent later, must not count as its sync point."""
    index = SharedIndex(1, 4)
    try:
        store = two_readers(index)
        r = store.reuse
        r.waiting(1, 1)
        r.waiting(1, 2)
        r.replied(1, 2, ok=True)
        at_reply = r.viewers[1].synced
        store.make_room(0.0)
        store.want = 1
        store.make_room(0.0)                  # an eviction after request 2's reply
        r.replied(1, 1, ok=True)              # the stale reply
        assert r.viewers[1].synced == at_reply < r.retired
        assert store.reclaim(0.0) == 0        # client 1 may read the evicted slot
    finally:
        index.close()


def test_seen_raises_the_sync_point_and_garbage_is_refused():
    index = SharedIndex(1, 4)
    try:
        store = two_readers(index)
        r = store.reuse
        store.want = 2
        store.make_room(0.0)
        assert len(r.limbo) == 2 and store.reclaim(0.0) == 0
        assert not r.seen(2, r.retired + 1) and not r.seen(2, "all")
        assert r.seen(1, r.retired) and r.seen(2, r.retired)
        assert store.reclaim(0.0) == 2
    finally:
        index.close()


def test_reports_of_a_slot_since_given_away_or_loading_are_late():
    """A report whose key left the slot it was seen in, or whose slot is loading (no client
    saw it READY there), is a late hit: counted, not heard or pinned (no reader is attached
    here, so nothing can be claimed: they are refused as garbage)."""
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
    assert (store.stats.hits, store.stats.late_hits, store.stats.bad_reports) == (3, 2, 2)
    assert not store.policy.held((1, 2)) and store.policy.held((2, 0)) == {s}
    store.check()


def test_claims_count_toward_the_pin_quota():
    index = SharedIndex(1, 8)
    try:
        store = Store(4, policy=make("lru"), index=index, reuse=Reuse())
        store.live.pin_quota = 2
        r = store.reuse
        r.attach(1)
        r.attach(2)
        for e in range(4):
            r.waiting(2, e)
            store.complete(store.fetch((2, e), [(0, e)], 0.0).new_loads[0], None)
            store.end_epoch(2, (2, e))
            r.replied(2, e, ok=True)
        seen = {e: store.key_slot[(0, e)] for e in range(4)}
        store.want = 3
        store.make_room(0.0)                  # three evicted, waiting for client 1
        gone = [e for e in range(4) if (0, e) not in store.key_slot]
        store.report_all((1, 0), [([(0, e)], [seen[e]]) for e in gone], quota=2)
        assert len(r.claims(1)) == 2 and store.stats.bad_reports == 1
        (kept,) = [k for k in store.key_slot if k[1] < 4]
        try:
            store.fetch((1, 0), [kept], 0.0)      # one more slot: over the quota with the claims
            raise AssertionError("a fetch over the quota, claims counted, was planned")
        except QuotaExceeded:
            pass
    finally:
        index.close()


def scenario(steps, quota: int = 0) -> HitPathMachine:
    """Run the model machine through ``steps(m, a, b)`` with two clients (a 4-slot arena):
    the issue's reproductions, step by step, with the model's invariants after each."""
    m = HitPathMachine()
    m.setup(n=2, quota=quota)
    try:
        a, b = m.clients[1], m.clients[2]
        for _ in steps(m, a, b):
            m.views_hold_their_keys()
            m.store_and_index_agree()
    finally:
        m.teardown()
    return m


def test_a_request_given_up_on_then_hits_keep_their_bytes():
    """B fetches a cold expert and gives up (a Timeout, or Ctrl-C) while it is read; it
    then fetches two resident experts; A's misses then need every slot."""
    def steps(m, a, b):
        m.send(a, "fetch", keys=[(0, 0), (0, 1)])
        m.handle(a)
        m.finish_reads()
        m.receive(a)
        m.begin(a)                               # a's views end; (0, 0) and (0, 1) unpinned
        m.handle(a)
        m.receive(a)
        yield
        m.send(b, "fetch", keys=[(1, 0)])        # cold: parked
        m.handle(b)
        m.interrupt(b)                           # Timeout / KeyboardInterrupt
        yield
        m.answer(b, 0, [0, 1])                   # its window is shut: not answered here
        assert not b.views
        m.send(b, "fetch", keys=[(0, 0), (0, 1)])    # so it asks the daemon, which pins them
        m.handle(b)
        m.receive(b)                             # request 1's reply is still to come
        assert len(b.views) == 2
        yield
        for e in (2, 3):                         # A misses: every free slot, then victims
            m.send(a, "fetch", keys=[(1, e)])
            m.handle(a)
            m.finish_reads()
            while a.inbox:
                m.receive(a)
            yield
        m.receive(b)                             # the late reply to request 1: skipped
        yield
    scenario(steps)


def test_a_stream_given_up_on_keeps_its_parts_and_its_window_shut():
    """B streams a fetch of a resident and a cold expert (``fetch_iter``), takes the
    first part, and leaves its loop while the cold one is read; its lease thread syncs
    meanwhile.  The part's view keeps its bytes while A evicts; B answers nothing
    itself until its next request's reply; the stream's later replies are skipped."""
    def steps(m, a, b):
        m.send(b, "fetch", keys=[(0, 0)])
        m.handle(b)
        m.finish_reads()
        m.receive(b)                             # (0, 0) resident, b's window open
        yield
        m.send(b, "fetch", keys=[(0, 0), (0, 1)], as_ready=True)
        m.handle(b)                              # parked; the part of (0, 0) sent at once
        m.receive(b)
        assert [k for _, k, _ in b.views] == [(0, 0), (0, 0)] and b.waiting is not None
        assert not b.hits.open
        m.sync(b)                                # the lease thread, between parts
        while b.outbox:
            m.handle(b)
        m.interrupt(b)                           # leaves the loop mid-stream
        yield
        m.answer(b, 0, [0])                      # its window is shut: not answered here
        assert len(b.views) == 2
        for e in (0, 1, 2):                      # A misses: every free slot, then victims
            m.send(a, "fetch", keys=[(1, e)])
            m.handle(a)
            m.finish_reads()
            while a.inbox:
                m.receive(a)
            yield
        while b.inbox:
            m.receive(b)                         # the stream's final reply: skipped
        assert not b.hits.open
        m.send(b, "fetch", keys=[(0, 0)])
        m.handle(b)
        m.finish_reads()
        while b.inbox:
            m.receive(b)
        assert b.hits.open                       # its next request's reply opens it
        yield
    scenario(steps)


def test_views_held_long_keep_their_bytes_and_the_lease_thread_frees_the_rest():
    """B answers two hits itself and holds the views (a long prefill) while A evicts:
    B's lease thread reports them, so they stay; every other slot is reused."""
    def steps(m, a, b):
        m.send(a, "fetch", keys=[(0, 0), (0, 1), (0, 2)])
        m.handle(a)
        m.finish_reads()
        m.receive(a)
        m.begin(a)
        m.handle(a)
        m.receive(a)
        m.answer(b, 0, [0, 1])                   # B answers two hits itself, then computes
        assert len(b.views) == 2
        yield
        m.sync(b)                                # its lease thread: reports and ``seen``
        m.handle(b)
        yield
        for e in range(4):
            m.send(a, "fetch", keys=[(1, e)])
            m.handle(a)
            m.finish_reads()
            while a.inbox:
                m.receive(a)
            m.sync(b)
            if b.outbox:
                m.handle(b)
            yield
        assert m.store.policy.held((b.id, 0)) == {b.views[0][0], b.views[1][0]}
    scenario(steps)


def test_a_client_whose_count_lags_past_a_lease_is_named():
    """A client below the count of a slot that has waited longer than the lease holds
    everyone's reuse back: ``lagging`` names it (the server drops it); a client blocked in
    a request, or one that reported the count, is not named."""
    index = SharedIndex(1, 4)
    try:
        store = two_readers(index)
        r = store.reuse
        store.want = 1
        store.make_room(5.0)                  # a slot waits from t=5 for client 2 (and 1)
        assert r.lagging(before=5.0) == [] and sorted(r.lagging(before=16.0)) == [1, 2]
        r.waiting(1, 9)                       # blocked in a request: reads nothing
        assert r.seen(2, r.retired)           # its lease thread's report
        assert r.lagging(before=16.0) == []
    finally:
        index.close()


def fill(m, c, keys):
    """``c`` fetches ``keys`` (misses), reads them, begins its next token (they are unpinned)."""
    m.send(c, "fetch", keys=keys)
    m.handle(c)
    m.finish_reads()
    m.receive(c)
    m.begin(c)
    m.handle(c)
    m.receive(c)


def miss(m, a, key, b):
    """A fetches ``key`` (a miss), retrying ``SlotsBusy`` as k3client does; ``b``'s lease
    thread reports in between."""
    for _ in range(6):
        m.send(a, "fetch", keys=[key])
        m.handle(a)
        m.finish_reads()
        while a.inbox:
            m.receive(a)
        if a.hits.open:
            return
        m.sync(b)
        while b.outbox:
            m.handle(b)
    raise AssertionError("A's miss never completed")


def test_a_failed_read_moves_the_count_clients_read_and_reuse_keeps_alike():
    """A failed read clears a LOADING entry: the index's count moves, and so must reuse's,
    or a ``seen`` read before an eviction would cover it (and an honest one be refused)."""
    def steps(m, a, b):
        fill(m, a, [(0, 0), (0, 1)])
        m.send(a, "fetch", keys=[(1, 0)])
        m.handle(a)
        m.fail_read(m.parked[0][4][0])
        m.receive(a)                           # ReadFailed
        yield
        m.sync(b)                              # B's lease thread reads the count ...
        m.answer(b, 0, [0])                    # ... then answers (0, 0) itself
        assert len(b.views) == 1
        yield
        fill(m, a, [(1, 1), (1, 2)])
        m.send(a, "fetch", keys=[(1, 3)])      # SlotsBusy; (0, 0) is evicted, waits for B
        m.handle(a)
        m.receive(a)
        yield
        m.handle(b)                            # B's count, read before that eviction
        yield
        miss(m, a, (1, 3), b)
        yield
    scenario(steps)


def test_with_a_quota_the_client_counts_the_slots_the_daemon_answered():
    """Quota 2: B's two misses answered by the daemon fill its quota, so it answers no more
    itself (the daemon would refuse those reports, and nothing would keep their slots)."""
    def steps(m, a, b):
        m.send(b, "fetch", keys=[(0, 0), (0, 1)])
        m.handle(b)
        m.finish_reads()
        m.receive(b)
        fill(m, a, [(0, 2), (0, 3)])
        m.answer(b, 0, [2, 3])
        assert len(b.views) == 2               # not answered here: over the quota
        yield
        miss(m, a, (1, 0), b)
        yield
    scenario(steps, quota=2)


def test_a_fetch_given_up_on_is_not_pinned_in_the_next_token():
    """Quota 2: B gives up on a cold fetch and begins a token; the fetch completes after
    that.  Pinning it in B's new token would count against a quota B counts without it."""
    def steps(m, a, b):
        fill(m, a, [(0, 0), (0, 1)])
        m.send(b, "fetch", keys=[(1, 0)])
        m.handle(b)                            # parked
        m.interrupt(b)                         # Timeout / Ctrl-C
        m.begin(b)
        m.handle(b)
        m.receive(b)
        yield
        m.finish_reads()                       # answered with an error, not pinned
        m.receive(b)
        assert not m.store.policy.held((b.id, b.epoch))
        m.answer(b, 0, [0, 1])
        assert len(b.views) == 2
        m.sync(b)
        m.handle(b)
        assert m.store.stats.bad_reports == 0
        yield
        fill(m, a, [(1, 1)])
        miss(m, a, (1, 2), b)
        yield
    scenario(steps, quota=2)


def test_reports_taken_for_a_message_that_never_left_go_with_the_next():
    """A KeyboardInterrupt between taking the reports and sending them: they go back first
    in line, so the lease thread's next message carries them before its count."""
    def steps(m, a, b):
        fill(m, a, [(0, 0), (0, 1)])
        m.answer(b, 0, [0])
        yield
        b.hits.open = False                    # Client._call, inside ``with self._io``
        b.hits.take()                          # ... KeyboardInterrupt here, before the send
        b.hits.failed()
        assert b.hits.reports
        yield
        fill(m, a, [(1, 0), (1, 1)])
        miss(m, a, (1, 2), b)
        yield
    scenario(steps)


def test_the_lease_thread_between_take_and_the_failure_sends_the_reports_first():
    """Ctrl-C after the client took its reports; its lease thread gets the socket before
    the failure is handled: its message carries those reports before its count."""
    def steps(m, a, b):
        fill(m, a, [(0, 0), (0, 1)])
        fill(m, a, [(1, 0), (1, 1)])           # 4 slots full, none pinned
        m.answer(b, 0, [0, 1])
        yield
        m.send(a, "fetch", keys=[(1, 2)])      # SlotsBusy: (0, 0)'s slot evicted, waits for B
        m.handle(a)
        m.receive(a)
        yield
        b.hits.open = False
        b.hits.take()                          # ... KeyboardInterrupt before the post
        m.sync(b)                              # the lease thread: the reports, then the count
        b.hits.failed()
        yield
        m.handle(b)
        miss(m, a, (1, 2), b)
        yield
    scenario(steps)


def test_a_layer_fetched_again_after_its_release_is_pinned_afresh():
    """B releases layer 0, then answers a fetch of it again before any message left: the
    release is cancelled (it would end the new view too), so A's misses cannot take it."""
    def steps(m, a, b):
        m.send(b, "fetch", keys=[(0, 0), (0, 1)])
        m.handle(b)
        m.finish_reads()
        m.receive(b)
        yield
        m.release_layer_of(b, 0)
        m.answer(b, 0, [0])                    # the layer again, in the same token
        assert len(b.views) == 1
        m.sync(b)
        m.handle(b)
        yield
        fill(m, a, [(1, 0), (1, 1)])
        miss(m, a, (1, 2), b)
        yield
    scenario(steps)


def test_a_released_layer_goes_to_misses_while_later_layers_stay_pinned():
    """B holds layers 0 and 1 and releases layer 0: A's misses evict its slots (B's views
    of them are over), while layer 1's stay pinned for B's token."""
    def steps(m, a, b):
        for layer in (0, 1):
            m.send(b, "fetch", keys=[(layer, 0)])
            m.handle(b)
            m.finish_reads()
            m.receive(b)
        m.release_layer_of(b, 0)
        assert not b.views[0][1][0] == 0 and len(b.released) == 1
        m.sync(b)
        m.handle(b)
        assert {m.store.slot_key[s] for s in m.store.policy.held((b.id, 0))} == {(1, 0)}
        yield
        fill(m, a, [(1, 1), (1, 2)])
        miss(m, a, (1, 3), b)
        miss(m, a, (0, 3), b)
        assert (0, 0) not in m.store.key_slot and m.store.key_slot[(1, 0)] == b.views[0][0]
        yield
    scenario(steps)


def test_a_release_the_lease_thread_failed_to_send_is_cancelled_by_a_lookup_since():
    """B releases layer 0; its lease thread takes the release for a message whose send
    fails (a ``ZMQError``: ``unsend``), and meanwhile B's thread answers layer 0 again
    (it needs no socket).  The release must not go back in line behind that lookup's
    report: it would unpin the new view, and A's misses could reuse its slot."""
    def steps(m, a, b):
        m.send(b, "fetch", keys=[(0, 0)])
        m.handle(b)
        m.finish_reads()
        m.receive(b)
        m.release_layer_of(b, 0)
        yield
        b.hits.sync()                          # the lease thread takes the release ...
        m.answer(b, 0, [0])                    # ... B's thread answers layer 0 again ...
        assert len(b.views) == 1
        b.hits.unsend()                        # ... and the send fails (a closing socket)
        m.sync(b)
        m.handle(b)
        yield
        fill(m, a, [(1, 0), (1, 1)])
        miss(m, a, (1, 2), b)
        miss(m, a, (1, 3), b)
        yield
    scenario(steps)


def test_a_release_inside_a_stream_of_its_layer_ends_the_stream():
    """B streams two cold experts of layer 0 and releases the layer between parts (its
    lease thread carries the release, which unpins the reads still running): the
    stream ends there, so B takes no view of a part sent after it, which A's misses
    could then rewrite."""
    def steps(m, a, b):
        fill(m, a, [(1, 0), (1, 1)])
        m.send(b, "fetch", keys=[(0, 0), (0, 1)], as_ready=True)
        m.handle(b)                            # parked, both cold
        m.release_layer_of(b, 0)
        m.sync(b)
        m.handle(b)
        yield
        m.finish_reads()
        while b.inbox:
            m.receive(b)                       # the parts and the reply: skipped
        assert not b.views and not b.hits.open
        yield
        miss(m, a, (1, 2), b)
        miss(m, a, (1, 3), b)
        yield
    scenario(steps)


def test_with_a_quota_a_release_counts_until_its_message_left():
    """Quota 2: B's two pins of layer 0 fill it; B releases the layer; its lease thread
    takes the release and fails to send it (``unsend``) while B's thread answers two
    experts of layer 1.  Counted without layer 0's pins, they fit; but the release goes
    after their reports, so the daemon would count them over the quota, refuse them,
    and keep nothing for B's views.  The release's slots count until its message left."""
    def steps(m, a, b):
        fill(m, a, [(1, 0), (1, 1)])
        m.send(b, "fetch", keys=[(0, 0), (0, 1)])
        m.handle(b)
        m.finish_reads()
        m.receive(b)
        m.release_layer_of(b, 0)
        yield
        b.hits.sync()                          # the lease thread takes the release ...
        m.answer(b, 1, [0, 1])                 # ... B's thread answers layer 1 meanwhile ...
        b.hits.unsend()                        # ... and the send fails
        m.sync(b)
        m.handle(b)
        assert m.store.stats.bad_reports == 0
        yield
        for key in ((1, 2), (1, 3), (0, 2), (0, 3)):
            miss(m, a, key, b)                 # every unpinned slot in turn
            m.begin(a)
            m.handle(a)
            m.receive(a)
            yield
    scenario(steps, quota=2)
