"""The daemon's predictor pays its way: pure integer streams through the real Store.

- the usefulness rule (``AutoPrefetch._judge``): under ``GAIN_POINTS`` used
  predictions per 100 keys it works on one token in ``skip`` (doubling, capped),
  at or above it works on every token; nothing is judged during the warm-up;
- a stream with nothing to predict backs it off to ``MAX_SKIP``, and a skipped
  token teaches the predictor nothing; a stream it predicts well never backs it
  off, and one that becomes predictable brings it back; replay backs off where
  the daemon's hooks do (same counters);
- passes of one fetch each (one layer per token, as ``bench/miss_path.py``): no
  next layer, no first layer, so nothing is read ahead to be released unused.
"""

import random

import pytest
from test_predictor import drive_auto

import k3d.cache.predict.prefetch as pf
from k3d.cache.policy import make
from k3d.cache.predict import AutoPrefetch, CoPredictor
from k3d.cache.store import Store
from k3d.observe.trace import BEGIN, FETCH, Event
from k3d.replay.engine import run

L, E = 6, 8


def pattern_token(t: int) -> list[list[int]]:
    a = t % 4
    return [[(2 * a + 3 * l) % E, (2 * a + 3 * l + 1) % E] for l in range(L)]


def random_token(rng) -> list[list[int]]:
    return [rng.sample(range(E), 2) for _ in range(L)]


@pytest.fixture
def quick(monkeypatch):
    """Judgements every 48 keys (4 tokens of 6 x 2): the rule, not its scale."""
    monkeypatch.setattr(pf, "JUDGE_KEYS", 48)


def fresh(slots: int = 2 * L + 4) -> tuple[Store, AutoPrefetch]:
    store = Store(slots, policy=make("cycle", L))
    return store, AutoPrefetch(store, CoPredictor(L, E))


def test_the_rule_backs_off_below_the_gain_and_comes_back_at_it():
    _, auto = fresh()
    auto._judged = pf.WARM_UP                            # past the warm-up
    skips = []
    for used in (39, 39, 39, 39, 39, 39, 40, 0):         # per 2000 keys: 1.95 points, ..., 2.0, 0
        auto._used, auto._keys = used, 2000
        auto._judge()
        skips.append(auto.skip)
    assert skips == [2, 4, 8, 16, 16, 16, 1, 2]
    assert auto.backoffs == 7


def test_no_judgement_backs_off_during_the_warm_up():
    _, auto = fresh()
    for _ in range(pf.WARM_UP):
        auto._used, auto._keys = 0, 2000
        auto._judge()
    assert auto.skip == 1 and auto.backoffs == 0
    auto._judge()
    assert auto.skip == 2


def test_nothing_to_predict_backs_off_and_skipped_tokens_teach_nothing(quick):
    store, auto = fresh()
    p = auto.predictor
    rng = random.Random(5)
    tokens = [random_token(rng) for _ in range(600)]
    taught = []

    def on_token(t):                                     # (skipped, fetches learned so far)
        taught.append((auto._tokens.get(1, 0) % auto.skip != 0, p.learned + p.c.pending()))

    ev = drive_auto(store, auto, tokens, on_token=on_token)
    assert auto.skip == pf.MAX_SKIP and auto.backoffs >= 4
    assert auto.as_dict()["skip"] == pf.MAX_SKIP
    # a skipped token learned nothing; a worked-on one learned its L fetches
    for (skipped, before), (_, after) in zip(taught, taught[1:]):
        assert after - before == (0 if skipped else L)
    assert sum(s for s, _ in taught) > len(tokens) // 2
    # exact replay: the engine's AutoPrefetch backs off at the same fetches
    for predictor in (None, "coact"):
        r = run(ev, "cycle", 2 * L + 4, predictor=predictor)
        assert (r.hits, r.misses, r.prefetched) == (store.stats.hits, store.stats.misses, store.stats.prefetched)


def test_a_stream_it_predicts_never_backs_it_off(quick):
    store, auto = fresh()
    drive_auto(store, auto, [pattern_token(t) for t in range(300)])
    assert auto.skip == 1 and auto.backoffs == 0
    assert store.stats.prefetch_hits > 0.8 * 300 * L * 2        # nearly every key, once learned


def test_it_comes_back_when_predictions_pay_again(quick):
    store, auto = fresh()
    rng = random.Random(9)
    drive_auto(store, auto, [random_token(rng) for _ in range(400)])
    assert auto.skip == pf.MAX_SKIP
    hits = store.stats.prefetch_hits
    drive_auto(store, auto, [pattern_token(t) for t in range(1500)])
    assert auto.skip == 1
    assert store.stats.prefetch_hits - hits > 1000


def one_layer_tokens(n: int, layers: int, k: int) -> list[Event]:
    """One fetch per token, cycling over ``layers`` layers of ``k`` experts each."""
    ev = []
    for t in range(n):
        ev += [Event(FETCH, 1, [(t % layers, e) for e in range(k)]), Event(BEGIN, 1)]
    return ev


@pytest.mark.parametrize("layers", [2, 3])
def test_one_layer_per_token_reads_nothing_ahead(layers):
    """Every pass ends after its one layer, and passes begin at changing layers: the next
    fetch is a new token's, at a layer nobody can name, so nothing is proposed (reads
    ahead here would be released unused, taking the demand misses' bandwidth)."""
    k = 4
    ev = one_layer_tokens(60, layers, k)
    p = CoPredictor(layers, k)
    for t in range(60):
        p.observe(1, [(t % layers, e) for e in range(k)])
        if t >= 2:
            assert p.next_layer(1) is None
        p.end_pass(1)
        if t >= 1:
            assert p.first_layer(1) is None
    r = run(ev, "cycle", 2 * k, predictor="coact")
    assert r.prefetched == 0 and r.cache_full == 0


def test_whole_passes_still_name_their_next_and_first_layers():
    p = CoPredictor(L, E)
    for t in range(3):
        for layer, experts in enumerate(pattern_token(t)):
            p.observe(1, [(layer, e) for e in experts])
            if t:                                      # (a layer never fetched is never proposed)
                assert p.next_layer(1) == (layer + 1 if layer + 1 < L else None)
        p.end_pass(1)
        assert p.first_layer(1) == 0


def test_a_skipped_clients_token_keeps_its_room():
    """A client in a skipped token is forgotten by the predictor, yet its token still
    needs slots: the room other clients' predictions may take leaves a whole pass for it."""
    store, auto = fresh(4 * L * 2)
    drive_auto(store, auto, [pattern_token(t) for t in range(3)])   # client 1: fetch size 2, ends token 3
    room = auto._room()
    auto.skip = 2                                        # its 4th token (3 ended: 3 % 2) is skipped
    auto.end_token(1)                                    # ... and its 5th (4 % 2 == 0) is not
    assert auto._room() == room
    auto.end_token(1)                                    # the 6th: 5 % 2, skipped
    assert 1 not in auto.predictor.clients()             # (forgotten: it would reserve nothing) ...
    assert auto._room() == room                          # ... yet its whole pass is still reserved


@pytest.mark.parametrize("extra", [0, 2, 6])
def test_two_clients_backed_off_never_fill_the_cache(quick, extra):
    """Clients interleaved token by token, one predictable and one not, so the predictor
    backs off with the two in different phases: no fetch ever finds the cache full."""
    rng = random.Random(extra)
    ev = []
    for t in range(400):
        routes = {1: pattern_token(t), 2: random_token(rng)}
        for layer in range(L):
            for c in (1, 2):
                ev.append(Event(FETCH, c, [(layer, e) for e in routes[c][layer]]))
        ev += [Event(BEGIN, 1), Event(BEGIN, 2)]
    r = run(ev, "cycle", 2 * L * 2 + extra, predictor="coact")
    assert r.cache_full == 0




def drive_two(store, auto, tokens, use_idle: bool) -> tuple[list, list]:
    """Clients 2 and 1 fetch ``tokens`` layer by layer, interleaved, client 2 one token
    behind (their skipped tokens differ); ``use_idle``: as the daemon, which calls
    ``after_fetch`` only where ``idle`` says something can come of it.  Returns (every
    fetch's and token start's proposals, whether each fetch was idle)."""
    out, idle = [], []
    for t in range(len(tokens) + 1):
        for layer in range(L):
            for c, tok in ((2, t - 1), (1, t)):
                if not 0 <= tok < len(tokens):
                    continue
                keys = [(layer, e) for e in tokens[tok][layer]]
                plan = store.fetch((c, tok), keys)
                for s in plan.new_loads:
                    store.complete(s, None)
                idle.append(use_idle and auto.idle(c))
                proposed, started = ([], []) if idle[-1] else auto.after_fetch(c, keys, plan.slots, 0)
                for s in started:
                    store.complete(s, None)
                out.append(proposed)
        for c, tok in ((2, t - 1), (1, t)):
            if 0 <= tok < len(tokens):
                store.end_epoch(c, (c, tok))
                auto.end_token(c)
                out.append(auto.begin_token(c)[0])
                for s in list(store.loads):
                    store.complete(s, None)
    return out, idle


def test_idle_fetches_skip_the_hooks_with_the_same_outcome(monkeypatch):
    """The daemon calls ``after_fetch`` only where ``idle`` says something can come of it
    (k3d.cache.fetch: a skipped fetch costs a counter, not two clock reads): the same
    proposals, counters and fetch count as calling it at every fetch, as replay does.
    Two clients work on alternate tokens (``skip`` 2), so one in a skipped token fetches
    what the daemon predicted for the other: those uses are counted all the same."""
    monkeypatch.setattr(pf, "JUDGE_KEYS", 1 << 30)          # skip stays where it is set
    rng = random.Random(1)
    tokens = [random_token(rng) for _ in range(200)]
    runs = []
    for use_idle in (False, True):
        store, auto = fresh(4 * L + 4)
        auto.skip = 2
        runs.append((*drive_two(store, auto, tokens, use_idle), store, auto))
    (out, _, store, auto), (out2, idle, store2, auto2) = runs
    assert out2 == out and sum(map(len, out)) > 0
    assert 0 < sum(idle) < len(idle)
    assert vars(store2.stats) == vars(store.stats) and store.stats.prefetch_hits > 0
    assert (auto2.fetches, auto2.used_in_time, auto2.used_late, auto2._used) == \
        (auto.fetches, auto.used_in_time, auto.used_late, auto._used)
