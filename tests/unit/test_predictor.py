"""The daemon's predictor on hand-made integer streams, and its glue through the store.

- a deterministic cross-layer pattern is learned fully: once seen, every next-layer
  expert is proposed, the next token's first layer from the token before, and the
  replay turns every demand miss after the first tokens into a prediction hit;
- a random stream: the calibration finds no information, so after the first tokens
  nothing is read ahead and the hit rate is never below the predictor-off run;
- the same stream gives the same proposals; state()/restore() carries them;
- learning in batches counts exactly what a fetch at a time counts, state() does
  not change what is proposed, deferred calibration counts what scoring at once
  counts (and, sampled one in ``cal_every``, estimates it); a room asked lazily
  proposes what a budget bounded before proposes; one predictor per client (replay --learn private) keeps clients apart,
  and shared learning beats it where clients teach each other.
"""

import random

import pytest
from hypothesis import given, settings, strategies as st

from k3d.cache.policy import make
from k3d.cache.predict import AutoPrefetch, CoPredictor, auto_id
from k3d.cache.store import Store
from k3d.observe.trace import AUTO, BEGIN, FETCH, Event
from k3d.replay.engine import run

L, E = 6, 8


def pattern_token(t: int) -> list[list[int]]:
    """Layer 0 picks one of four pairs; every later layer's pair is a fixed function of it."""
    a = t % 4
    return [[(2 * a + 3 * l) % E, (2 * a + 3 * l + 1) % E] for l in range(L)]


def events_of(tokens) -> list[Event]:
    ev = []
    for route in tokens:
        for layer, experts in enumerate(route):
            ev.append(Event(FETCH, 1, [(layer, e) for e in experts]))
        ev.append(Event(BEGIN, 1))
    return ev


def test_learns_a_cross_layer_pattern_fully():
    p = CoPredictor(L, E)
    for t in range(200):                       # proposing measures the calibration: budget 0
        for layer, experts in enumerate(pattern_token(t)):
            p.observe(1, [(layer, e) for e in experts])
            p.propose(1, layer + 1, 0, ())
    for t in range(200, 204):
        route = pattern_token(t)
        for layer in range(L - 1):
            p.observe(1, [(layer, e) for e in route[layer]])
            got = p.propose(1, layer + 1, 2, ())
            assert sorted(k for k, _ in got) == sorted((layer + 1, e) for e in route[layer + 1])
            assert all(c > 0.9 for _, c in got)


def test_learns_the_next_tokens_first_layer():
    """Token t + 1's first layer follows from token t's last layers: proposed at the token's start."""
    p = CoPredictor(L, E)
    for t in range(200):
        for layer, experts in enumerate(pattern_token(t)):
            p.observe(1, [(layer, e) for e in experts])
            p.propose(1, layer + 1, 0, ())
        assert p.next_layer(1) is None and p.remaining(1) == 0
        p.end_pass(1)
        assert p.first_layer(1) == 0 and p.remaining(1) == L * 2
        p.propose(1, 0, 0, ())
    for t in range(200, 204):
        for layer, experts in enumerate(pattern_token(t)):
            p.observe(1, [(layer, e) for e in experts])
        p.end_pass(1)
        got = p.propose(1, p.first_layer(1), 2, ())
        assert sorted(k for k, _ in got) == sorted((0, e) for e in pattern_token(t + 1)[0])
        assert all(c > 0.9 for _, c in got)


def test_replay_turns_the_pattern_into_prediction_hits():
    ev = events_of(pattern_token(t) for t in range(300))
    off = run(ev, "cycle", 2 * L, predictor="none")
    on = run(ev, "cycle", 2 * L, predictor="coact")
    # one token's pins is the whole cache: nothing may be read ahead, nothing changes
    assert on.prefetched == 0 and (on.hits, on.misses) == (off.hits, off.misses)
    off = run(ev, "cycle", 2 * L + 4, predictor="none")
    on = run(ev, "cycle", 2 * L + 4, predictor="coact")
    assert on.cache_full == 0 and on.hit_rate > off.hit_rate
    # once learned (the first half), every layer is read ahead, the first from the
    # token before: the second half misses nothing, and nothing is read for nothing
    half = run(ev[:len(ev) // 2], "cycle", 2 * L + 4, predictor="coact")
    assert on.misses - half.misses == 0, (on, half)
    assert on.prefetch_unused - half.prefetch_unused == 0
    assert on.auto_prefetched == on.prefetched and on.auto_hits == on.prefetch_hits


def random_tokens(n: int, seed: int):
    rng = random.Random(seed)
    return [[rng.sample(range(E), 2) for _ in range(L)] for _ in range(n)]


def test_random_stream_does_nothing_harmful():
    ev = events_of(random_tokens(400, 7))
    for slots in (2 * L, 2 * L + 4, 3 * L, 5 * L):
        off = run(ev, "cycle", slots, predictor="none")
        on = run(ev, "cycle", slots, predictor="coact")
        assert on.cache_full == 0
        assert on.hit_rate >= off.hit_rate - 0.01, (slots, on, off)
        # only while the calibration is still empty (the first tokens): then nothing
        assert on.prefetched <= 0.02 * (on.hits + on.misses), (slots, on)


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 10**6), st.integers(2 * L, 6 * L))
def test_deterministic_and_no_cache_full(seed, slots):
    ev = events_of(random_tokens(30, seed) + [pattern_token(t) for t in range(30)])
    a = run(ev, "cycle", slots, predictor="coact")
    b = run(ev, "cycle", slots, predictor="coact")
    assert a == b and a.cache_full == 0



def drive_auto(store, auto, tokens, before_learning=lambda: None, on_token=lambda t: None) -> list:
    """Client 1 fetches ``tokens`` (per token, each layer's experts) through ``store`` with
    ``auto`` after each fetch and at each token's start, reads completing at once, as the
    daemon calls them; returns the events its trace would hold.  ``on_token(t)`` runs before
    token ``t``, ``before_learning()`` before each ``after_fetch``."""
    ev = []
    for t, token in enumerate(tokens):
        on_token(t)
        for layer, experts in enumerate(token):
            keys = [(layer, e) for e in experts]
            plan = store.fetch((1, t), keys)
            for s in plan.new_loads:
                store.complete(s, None)
            before_learning()
            proposed, started = auto.after_fetch(1, keys, plan.slots, 0)
            for s in started:
                store.complete(s, None)
            ev += [Event(FETCH, 1, keys), Event(AUTO, 1, proposed)]
        store.end_epoch(1, (1, t))
        auto.end_token(1)
        proposed, started = auto.begin_token(1)       # the next token's first layer
        for s in started:
            store.complete(s, None)
        ev += [Event(BEGIN, 1), Event(AUTO, 1, proposed)]
    return ev

def test_recorded_auto_lines_replay_like_the_class():
    """What the daemon writes (auto lines after each fetch and begin) replays to the same counters."""
    store = Store(2 * L + 4, policy=make("cycle", L))
    auto = AutoPrefetch(store, CoPredictor(L, E))
    ev = drive_auto(store, auto, [pattern_token(t) for t in range(150)])
    want = (store.stats.hits, store.stats.misses, store.stats.prefetched, store.stats.prefetch_unused)
    for predictor in (None, "coact"):
        r = run(ev, "cycle", 2 * L + 4, predictor=predictor)
        assert (r.hits, r.misses, r.prefetched, r.prefetch_unused) == want
    assert store.book.quality[auto_id(1)].prefetched == store.stats.prefetched > 0
    assert auto.as_dict()["issued"] == store.stats.prefetched


def test_state_round_trip_and_bad_state():
    p = CoPredictor(L, E)
    for t in range(50):
        for layer, experts in enumerate(pattern_token(t)):
            p.observe(1, [(layer, e) for e in experts])
            p.propose(1, layer + 1, 0, ())
    q = CoPredictor(L, E)
    saved = p.state()                          # the counts as folded, without folding
    q.restore(saved)
    assert q.state() == saved
    p.fold()                                   # a restored predictor proposes as the saved one after its fold
    assert p.state() == saved
    for r in (p, q):
        r.observe(2, [(0, 0), (0, 1)])
    got = q.propose(2, 1, 2, ())
    assert [k for k, _ in got] == [(1, 3), (1, 4)] and got == p.propose(2, 1, 2, ())
    before = q.state()
    for bad in ({}, {"predictor": "coact", "depth": 4, "layers": 1, "experts": 1, "visits": [[99, 1]], "pop": [],
                     "seen": [], "co": [], "cal_n": [0] * 20, "cal_hit": [0] * 20}):
        try:
            q.restore(bad)
        except ValueError:
            pass
        else:
            raise AssertionError("bad state accepted")
    assert q.state() == before


def test_an_arena_holding_the_whole_model_never_learns_or_proposes_and_replays_alike():
    """An arena of a slot per key of the predictor's shape (layers x experts) reads each key at
    most once: the predictor stays idle from the start (no count learned, nothing proposed), and
    a replay at that size, which knows only the trace, decides the same.  One slot fewer, and it
    works."""
    tokens = [pattern_token(t) for t in range(60)]
    fresh = CoPredictor(L, E).state()
    for slots, idle in ((L * E, True), (L * E + 3, True), (L * E - 1, False)):
        store = Store(slots, policy=make("cycle", L))
        auto = AutoPrefetch(store, CoPredictor(L, E))
        ev = drive_auto(store, auto, tokens)
        assert auto.holds_model is idle and auto.as_dict()["holds_model"] is idle
        assert (auto.predictor.state() == fresh) is idle
        assert (store.stats.prefetched == 0) is idle
        r = run(ev, "cycle", slots, predictor="coact")
        assert (r.hits, r.misses, r.prefetched) == (store.stats.hits, store.stats.misses, store.stats.prefetched)


def test_once_every_known_expert_is_resident_it_stops_learning_and_replays_alike():
    """A model with fewer experts than its shape (its layer 0 is dense: no key there) in an arena
    just its size: once every known expert is resident nothing can be predicted again, so the
    daemon's predictor neither learns nor proposes, and a replay, which goes on learning, still
    counts the same."""
    known = frozenset((layer, e) for layer in range(1, L) for e in range(E))
    store = Store(len(known), policy=make("cycle", L))
    auto = AutoPrefetch(store, CoPredictor(L, E), known=known)
    assert not auto.holds_model
    states = []

    def before_learning():                                # the counts when the model became resident
        if len(store.key_slot) == len(known) and not states:
            states.append(auto.predictor.state())

    tokens = [[[], *random_tokens(1, t)[0][1:]] for t in range(40)]
    ev = drive_auto(store, auto, tokens, before_learning)
    learned = states[0] if states else None
    assert learned is not None and len(store.key_slot) == len(known)
    assert learned != CoPredictor(L, E).state()          # it did learn before
    assert auto.predictor.state() == learned
    r = run(ev, "cycle", len(known), predictor="coact")
    assert (r.hits, r.misses, r.prefetched) == (store.stats.hits, store.stats.misses, store.stats.prefetched)


def reference_counts(tokens, depth: int) -> dict:
    """The counts a fetch at a time, by plain loops: what the batched learning must equal."""
    pop, seen, co, visits = {}, {}, {}, {}
    prev = []
    for route in tokens:
        hist = []
        for m, picks in enumerate(route):
            ctx = [(m - l, p) for l, p in hist] if hist else [(m + len(route) - l, p) for l, p in prev]
            visits[m] = visits.get(m, 0) + 1
            for e in picks:
                pop[(m, e)] = pop.get((m, e), 0) + 1
            for d, ps in ctx:
                if 1 <= d <= depth:
                    for a in ps:
                        seen[(m, d - 1, a)] = seen.get((m, d - 1, a), 0) + 1
                        for e in picks:
                            co[(m, d - 1, a, e)] = co.get((m, d - 1, a, e), 0) + 1
            hist = (hist + [(m, sorted(picks))])[-depth:]
        prev = hist
    return {"visits": sorted([m, n] for m, n in visits.items()), "pop": sorted([*k, n] for k, n in pop.items()),
            "seen": sorted([*k, n] for k, n in seen.items()), "co": sorted([*k, n] for k, n in co.items())}


def test_batched_learning_counts_what_a_fetch_at_a_time_counts():
    """Learning appends to a buffer and folds in batches: the counts (state(), which folds a
    copy) are exactly the plain per-fetch counts, at every point, folded or not."""
    tokens = random_tokens(40, 11)
    p = CoPredictor(L, E, depth=3)
    for n, route in enumerate(tokens):
        for layer, experts in enumerate(route):
            p.observe(1, [(layer, e) for e in experts])
        p.end_pass(1)
        if n in (0, 5, 39):
            got = {k: sorted(v) for k, v in p.state().items() if k in ("visits", "pop", "seen", "co")}
            assert got == reference_counts(tokens[:n + 1], 3)
    assert p.learned > 0 and p.c.pending() < 40 * L       # it did fold, and state() did not


def test_state_does_not_change_what_is_proposed():
    """A warm-restart save (state()) mid-stream leaves the proposals as they were: the
    daemon saves, replay does not, and both must propose alike."""
    a, b = CoPredictor(L, E), CoPredictor(L, E)
    for t in range(120):
        for layer, experts in enumerate(pattern_token(t)):
            keys = [(layer, e) for e in experts]
            for p in (a, b):
                p.observe(1, keys)
            a.state()
            assert a.propose(1, layer + 1, 2, ()) == b.propose(1, layer + 1, 2, ())
        for p in (a, b):
            p.end_pass(1)


def test_a_layer_reaching_the_window_has_its_counts_halved_at_the_fold():
    p = CoPredictor(2, 4, window=8)
    for t in range(30):
        p.observe(1, [(0, t % 2), (0, 2)])
        p.observe(1, [(1, 3)])
    p.fold()
    s = p.state()
    assert all(v < 8 for *_, v in s["visits"]) and all(v <= 8 for *_, v in s["pop"])
    pop = {(m, e): v for m, e, v in s["pop"]}
    assert pop[(0, 2)] == dict((m, v) for m, v in s["visits"])[0]     # always picked: still every visit


def test_per_client_learning_keeps_clients_apart():
    """PerClient: a client's proposals come from its own stream only."""
    from k3d.cache.predict.private import PerClient
    p = PerClient(lambda: CoPredictor(L, E))
    for t in range(200):
        for layer, experts in enumerate(pattern_token(t)):
            p.observe(1, [(layer, e) for e in experts])
            p.propose(1, layer + 1, 0, ())
        p.end_pass(1)
    p.observe(1, [(0, e) for e in pattern_token(200)[0]])
    assert sorted(k for k, _ in p.propose(1, 1, 2, ())) == sorted((1, e) for e in pattern_token(200)[1])
    p.observe(2, [(0, e) for e in pattern_token(200)[0]])
    assert p.propose(2, 1, 2, ()) == []                      # client 2 learned nothing yet
    assert sorted(p.clients()) == [1, 2] and p.remaining(2) == (L - 1) * 2


def test_shared_learning_beats_private_learning_where_it_must():
    """Two clients playing the same pattern: one predictor taught by both streams learns it in
    half the tokens, so the shared arena hits more with shared learning than with one
    predictor per client (the arena is the same, so the difference is the learning)."""
    from k3d.replay.sharing import compare
    ev = events_of(pattern_token(t) for t in range(40))
    size = 2 * (2 * L + 4)
    row = compare(ev, 2, [size], ["cycle"], offset=1, predictor="coact", learn="both")["cycle"][size]
    assert row["shared"] > row["shared_learn_private"] >= row["shared_no_predictor"]
    assert row["learning_gain"] > 0
    assert row["arena_gain"] == round(100 * (row["shared_learn_private"] - row["private"]), 2)
    alone = compare(ev, 2, [size], ["cycle"], offset=1, predictor="coact", learn="private")["cycle"][size]
    assert alone["shared"] == row["shared_learn_private"]


def test_replay_cli_learn_both_splits_the_gain(tmp_path, capsys):
    """``k3d replay --clients 2 --learn both --json``: the learning split per size, and sizes
    whose private arenas cannot hold a token are the split alone (no error)."""
    import json

    from k3d.commands.cli import main as k3d_main
    trace = tmp_path / "pattern.trace"
    trace.write_text("".join(f"{t} L{layer} n=2 {a} {b}\n" for t in range(40)
                             for layer, (a, b) in enumerate(pattern_token(t))))
    size = 2 * (2 * L + 4)
    args = ["replay", str(trace), "--clients", "2", "--policy", "cycle", "--predictor", "coact", "--json"]
    assert k3d_main([*args, "--slots", f"{2 * L + 4},{size}", "--learn", "both"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["learn"] == "both" and out["clients"] == 2
    small, row = out["results"]["cycle"][str(2 * L + 4)], out["results"]["cycle"][str(size)]
    assert small["private"] is None and small["arena_gain"] is None and "learning_gain" in small
    assert row["shared"] >= row["shared_learn_private"] and row["learning_gain"] >= 0
    assert k3d_main([*args, "--slots", str(2 * L + 4)]) == 2          # --learn shared: still an error
    assert "below one token's pins" in capsys.readouterr().err


@pytest.mark.parametrize("experts, clients", [(E, 1), (32, 1), (E, 2), (32, 2)])
def test_deferred_calibration_counts_what_scoring_at_once_counts(monkeypatch, experts, clients):
    """A proposal that cannot propose anything has its candidates binned at the fold
    (score.resolve), not at once: the calibration counts are the same either way, also
    when another client's fetch folds while the proposal waits for its layer."""
    from k3d.cache.predict import counts

    rng = random.Random(3)
    tokens = [[rng.sample(range(experts), 2) for _ in range(L)] for _ in range(60)]
    tokens += [[[(2 * (t % 4) + 3 * l) % experts, (2 * (t % 4) + 3 * l + 1) % experts] for l in range(L)]
               for t in range(60)]

    def drive(p):
        for t, route in enumerate(tokens):
            for layer, experts_ in enumerate(route):
                for c in range(1, clients + 1):       # client c plays the tokens c - 1 later
                    mine = tokens[t - c + 1][layer] if t >= c - 1 else experts_
                    p.observe(c, [(layer, e) for e in mine])
                    if layer + 1 < L:
                        p.propose(c, layer + 1, 2, {(layer + 1, mine[0])})
            for c in range(1, clients + 1):
                p.end_pass(c)
        return p.state(), p._deferrals

    lazy, n_lazy = drive(CoPredictor(L, experts, cal_every=1))
    init = counts.Tables.__init__

    def at_once(self, *a):
        init(self, *a)
        self.top[:] = 1.0                           # every candidate reachable: never defer
        self.best_l = [1.0] * len(self.best_l)

    monkeypatch.setattr(counts.Tables, "__init__", at_once)
    eager, n_eager = drive(CoPredictor(L, experts, cal_every=1))
    assert n_lazy > 0 and n_eager == 0
    assert lazy == eager


def random_stream(experts: int, tokens: int, seed: int) -> list:
    rng = random.Random(seed)
    return [[rng.sample(range(experts), 2) for _ in range(L)] for _ in range(tokens)]


@pytest.mark.parametrize("experts", [16, 32])
def test_sampled_deferred_calibration_estimates_the_whole(experts):
    """On a stream with nothing to predict every proposal defers; one in ``cal_every``
    feeds the calibration, weighing ``cal_every``: the counts per bin are those of
    every deferral, up to sampling (a count left unweighted would be a quarter)."""
    def drive(p):
        for route in random_stream(experts, 400, 11):
            for layer, picks in enumerate(route):
                p.observe(1, [(layer, e) for e in picks])
                if layer + 1 < L:
                    p.propose(1, layer + 1, 2, ())
            p.end_pass(1)
        st = p.state()
        return st["cal_n"], st["cal_hit"], p._deferrals

    n_all, hit_all, q_all = drive(CoPredictor(L, experts, cal_every=1))
    n_4, hit_4, q_4 = drive(CoPredictor(L, experts, cal_every=4))
    assert min(q_all, q_4) > 0.8 * 400 * (L - 1)                  # (nearly) every proposal defers
    assert abs(sum(n_4) - sum(n_all)) <= 0.05 * sum(n_all)
    for b, n in enumerate(n_all):
        if n >= 2000:                                               # well-filled bins: the same frequency
            assert abs(hit_4[b] / max(n_4[b], 1) - hit_all[b] / n) < 0.03


@pytest.mark.parametrize("experts, cal_every", [(E, 1), (E, 2), (32, 2)])
def test_a_lazy_room_proposes_what_an_eager_budget_proposes(experts, cal_every):
    """``AutoPrefetch`` gives ``propose`` its room as a callable, asked only when something
    could be proposed: the proposals, and what is learned, are those of the budget
    bounded before the call, and most proposals never ask."""
    stream = [pattern_token(t) if t % 3 else r for t, r in enumerate(random_stream(E, 240, 5))]
    if experts != E:
        stream = [[[(e * 5 + t) % experts for e in picks] for picks in route] for t, route in enumerate(stream)]
    a, b = CoPredictor(L, experts, cal_every=cal_every), CoPredictor(L, experts, cal_every=cal_every)
    asked, calls, proposed = [0], 0, 0

    def room(n):
        def ask():
            asked[0] += 1
            return n
        return ask

    for t, route in enumerate(stream):
        for layer, picks in enumerate(route):
            for p in (a, b):
                p.observe(1, [(layer, e) for e in picks])
            if layer + 1 < L:
                res, n = {(layer + 1, picks[0])}, t % 3           # (room 0 at every third token)
                want = a.propose(1, layer + 1, min(2, n), res, 0.4)
                assert b.propose(1, layer + 1, 2, res, 0.4, room(n)) == want
                calls += 1
                proposed += bool(want)
        a.end_pass(1)
        b.end_pass(1)
    assert proposed > 0 and 0 < asked[0] < calls
    assert a.state() == b.state()



@pytest.mark.parametrize("experts", [8, 32])
def test_propose_reads_residency_rows_as_a_container(experts):
    """``propose`` gives the same proposals, and learns the same, whether the resident
    keys come as a container or as the store's rows (``ResidentRows.row``), for small
    (list arithmetic) and dense models."""
    from k3d.cache.resident import ResidentRows
    rng = random.Random(5)
    a, b = CoPredictor(layers=4, experts=experts), CoPredictor(layers=4, experts=experts)
    keys: dict = {}
    rows = ResidentRows(keys)
    proposed = 0
    for token in range(300):
        for layer in range(4):
            # a pattern to learn (expert e of layer L follows e of layer L - 1), with noise
            base = [(token + i) % experts for i in range(2)] if rng.random() < 0.8 else rng.sample(range(experts), 2)
            picks = [(layer, e) for e in sorted(set(base) | set(rng.sample(range(experts), 2)))]
            for key in picks:
                keys[key] = 0
                rows.add(key)
            for p in (a, b):
                p.observe(1, picks)
            for key in rng.sample(sorted(keys), len(keys) // 3):
                del keys[key]
                rows.discard(key)
            if layer < 3:
                got = a.propose(1, layer + 1, 4, set(keys))
                assert got == b.propose(1, layer + 1, 4, rows)
                proposed += len(got)
        for p in (a, b):
            p.end_pass(1)
    a.fold(), b.fold()
    assert a.state() == b.state() and proposed
