"""The daemon's own predictions: a predictor driven by the fetch stream, through the store.

``AutoPrefetch`` is the one piece both the daemon (``k3d.cache.fetch.FetchService``) and
``k3d replay`` (``k3d.replay.engine``) call, with the same arguments at the same
points, so a replay reproduces the daemon's predictions exactly:

- ``after_fetch(client, keys, slots, client_started, now)``: after a fetch is
  planned and the client's own predictions (``predicted=``) were applied.  It
  counts the daemon's predictions this fetch used (in time, or late: still being
  read), lets the predictor learn the fetch, then asks it for the layer after this
  one and hands the proposals to ``Store.predict``.  Returns the keys proposed and
  the slots to read (BACKGROUND).  ``predict=False`` (a fetch the client answered
  itself and reported later: it is past that layer) only counts and learns.
- ``end_token(client)``: the client began its next token: the daemon's predictions
  for it are released and the unused ones demoted and counted (``Store.end_epoch``).
- ``begin_token(client, now)``: right after ``end_token``: the predictor proposes
  the token's first layer from the last layers of the token before (no client
  can name those: its router for them has not run yet).  Returns as ``after_fetch``.
- ``drop(client)``: the client left: as ``end_token``, and its context goes.

Guarantees:
- A client's own predictions come first: the daemon fills what is left of the
  fetch's budget (``budget``, or the fetch's key count when 0).
- Never more predictions than free + evictable slots beyond what every client's
  current token still needs (``CoPredictor.remaining``), so the daemon's
  predictions (pinned until that client's next token, as every prediction) can
  never make a later fetch of the token find the cache full.
- Each proposal passes the policy's ``admits`` (``Store.predict``); proposals
  below the predictor's calibrated ``min_prob`` are never made.
- A read budget (``_afford``): the expected unused reads of the predictions started
  (the sum of 1 - confidence: the confidences are measured frequencies) stay within
  ``slack`` (``READ_SLACK``) times the reads demand needed (the store's misses plus
  the predictions used); so total reads stay within about 1 + ``slack`` times
  those of no predictions (more only by the calibration's error and by misses
  of what a prediction evicted).  A proposal is taken only while the
  allowance left covers ``RESERVE`` times its expected waste: where reads are
  scarce only sure proposals go, and the budget is spent where it pays most.
  And the expected share of predictions used stays at least ``precision``
  (``PRECISION``): a sure one earns credit an unsure one may spend.
- Predictions never cross a token boundary: the next token's first layer is
  proposed at ``begin_token``, never before (a proposal made earlier would be
  demoted at the token's start, before its fetch).
- It pays its way (``_judge``): every ``JUDGE_KEYS`` keys fetched in the tokens it
  works on, it compares the predictions used (in time or late) with those keys.
  Below ``GAIN_POINTS`` hit-rate points (used * 100 < GAIN_POINTS * keys) it backs
  off: it works on one token in ``skip`` per client (doubled at each such
  judgement, up to ``MAX_SKIP``), and in the others neither learns nor proposes
  (a fetch costs it a counter; the predictor forgets the client's context, so a
  token it skipped never teaches a wrong one).  At or above, ``skip`` is 1 again.
  Every figure is a count of the stream, so replay backs off where the daemon does.
- It stays idle where the arena holds the whole model (``holds_model``: at least
  one slot per key of the predictor's shape, layers x experts): there, every key
  is read at most once in the daemon's life, so a prediction could save at most
  one first-touch miss per key, while learning and proposing would cost the loop
  thread on every fetch (bench/README.md, "vLLM overhead with tensor
  parallelism": 0.36 ms of the daemon's CPU per step of a two-rank engine whose
  experts were all resident but one, on cores the ranks need).  The daemon and
  ``k3d replay`` decide it from the same two figures, so replay stays exact.

The daemon's predictions are kept under a client id of their own per client,
``-1 - client`` (``auto_id``), so the store's per-client prediction quality keeps
them apart from the client's own predictions, and the client's
``end_epoch`` never touches them (``end_token`` does).

Pure: the store, the predictor and integers; the caller starts the reads.
"""

from __future__ import annotations

from k3d.observe.stats import PredictionStats

READ_SLACK = 0.2        # expected unused reads allowed per read demand needs
PRECISION = 0.4         # the least expected share of predictions used, on average
RESERVE = 16.0          # how many times its expected waste a take needs left in the allowance
JUDGE_KEYS = 2048       # keys fetched in worked-on tokens between two judgements of usefulness
GAIN_POINTS = 2         # hit-rate points (used predictions per 100 keys) below which it backs off
MAX_SKIP = 16           # backed off the furthest: one token in this many per client
WARM_UP = 8             # judgements that only measure: a predictor learns before it can be useful


def auto_id(client: int) -> int:
    """The store's client id for the daemon's predictions on behalf of ``client``."""
    return -1 - client


class AutoPrefetch:
    def __init__(self, store, predictor, budget: int = 0, read_lead: int | None = None,
                 slack: float = READ_SLACK, precision: float = PRECISION, credit_cap: float = 4.0,
                 known=None):
        """``read_lead``: None (the daemon): a used prediction is late when its slot is
        still LOADING.  An int (replay, where reads complete at once): late when fewer
        than ``read_lead`` fetches came between the prediction and its use.
        ``slack``: expected unused reads allowed per read demand needs (``_afford``).
        ``precision``: the share of predictions expected to be used, kept on average
        (``_afford``); ``credit_cap`` bounds how much a run of sure predictions may
        lend to later unsure ones.
        ``known``: the keys that exist (a container;
        None: every key the predictor names), so nothing else is ever proposed."""
        self.store, self.predictor, self.budget, self.read_lead = store, predictor, budget, read_lead
        self.slack, self.precision, self.credit_cap = slack, precision, credit_cap
        self.credit = 0.0
        self.known = known
        self.holds_model = store.slots >= predictor.layers * predictor.experts
        self._all_known = None                   # (layers, experts) when every such key is known
        self.waste = 0.0                         # expected unused reads of the predictions started
        self.fetches = 0
        self._out: dict[int, tuple] = {}         # slot -> (client, key, fetch count when predicted)
        self.used_in_time = 0
        self.used_late = 0
        # usefulness (_judge): keys fetched and predictions used since the last judgement
        self.skip = 1                            # works on one token in this many per client
        self.backoffs = 0                        # judgements that found it below GAIN_POINTS
        self._keys = self._used = self._judged = 0
        self._judge_at = JUDGE_KEYS              # (the halved keys carried over, plus JUDGE_KEYS new)
        self._tokens: dict[int, int] = {}        # client -> tokens it ended (worked on: % skip == 0)
        self._size: dict[int, int] = {}          # client -> its fetch size when it was last forgotten
        self.gone = PredictionStats()            # the daemon's figures for clients that left
        # The loop thread's CPU in these hooks (and in starting their reads), ns: the
        # daemon's caller (k3d.cache.fetch) adds it; replay, which has no such thread, never does
        self.cpu_ns = 0

    # -- the hooks ----------------------------------------------------------------
    def after_fetch(self, client: int, keys, slots, client_started: int = 0, now: float = 0.0,
                    predict: bool = True) -> tuple[list, list[int]]:
        """Learn ``client``'s fetch of ``keys`` (planned in ``slots``), then predict.
        Returns (the keys handed to ``Store.predict``, the slots it started)."""
        self.fetches += 1
        out = self._out
        if out:
            store = self.store
            for s, key in zip(slots, keys):
                o = out.get(s)
                if o is None or o[1] != key:
                    continue
                del out[s]
                self._used += 1
                if self.read_lead is None:
                    late = store.state[s] == "loading"
                else:
                    late = self.fetches - o[2] < self.read_lead
                if late:
                    self.used_late += 1
                else:
                    self.used_in_time += 1
        if self._tokens.get(client, 0) % self.skip or self._all_resident():
            return [], []
        p = self.predictor
        p.observe(client, keys)
        self._keys += len(keys)
        if self._keys >= self._judge_at:
            self._judge()
        if not predict:
            return [], []
        layer = p.next_layer(client)
        if layer is None:                        # the next token's first layer: begin_token
            return [], []
        return self._predict(client, layer, (self.budget or len(keys)) - client_started, now)

    def idle(self, client: int, fetches: int = 1) -> bool:
        """Whether nothing can come of ``client``'s next ``fetches`` fetches (none of the
        daemon's predictions outstanding to count, and the client's token skipped or
        nothing to predict): then they are counted here, as ``after_fetch`` would count
        them, and the caller need not call (nor measure) the hooks that would do nothing."""
        if self._out or not (self._tokens.get(client, 0) % self.skip or self._all_resident()):
            return False
        self.fetches += fetches
        return True

    def after_reports(self, client: int, reports) -> None:
        """``after_fetch`` without predicting, for each of ``client``'s reported fetches
        (``[(keys, slots), ...]``); nothing per report while nothing can come of it."""
        if self.idle(client, len(reports)):
            return
        for keys, slots in reports:
            self.after_fetch(client, keys, slots, predict=False)

    def begin_token(self, client: int, now: float = 0.0) -> tuple[list, list[int]]:
        """``client`` began its next token (after ``end_token``): predict the first layer
        of the token from the last layers of the one before.  Returns as ``after_fetch``."""
        if self._tokens.get(client, 0) % self.skip or self._all_resident():
            return [], []
        p = self.predictor
        layer = p.first_layer(client)
        if layer is None:
            return [], []
        return self._predict(client, layer, self.budget or p.fetch_size(client), now)

    def _predict(self, client: int, layer: int, budget: int, now: float) -> tuple[list, list[int]]:
        store = self.store
        # (_afford takes nothing under the floor: the predictor need not score then;
        # _room, a sum over clients, only once there is something to take)
        allowance = self._allowance()
        props = self.predictor.propose(client, layer, budget, self._resident(),
                                       max(1.0 - allowance / RESERVE, self.precision - self.credit), self._room)
        proposed = self._afford(props, allowance)
        if not proposed:
            return [], []
        started = store.predict(auto_id(client), proposed, now)
        conf = dict(props)
        out = self._out
        for s in started:
            key = store.slot_key[s]
            out[s] = (client, key, self.fetches)
            self.waste += 1.0 - conf[key]
            self.credit += conf[key] - self.precision
        self.credit = min(self.credit, self.credit_cap)
        return proposed, started

    def _all_resident(self) -> bool:
        """Nothing can be predicted that pays: the arena holds the model (``holds_model``,
        module docstring), or every expert of the model is resident (``known`` given: the
        daemon).  Only an arena that holds the whole model gets to the second, and it stays
        so (nothing is evicted while a slot is free), so no prediction can ever be made
        again: learning and proposing stop, and cost nothing per fetch.  ``k3d replay`` (no
        ``known``) goes on learning there, but can propose nothing either, so its counters
        stay the daemon's."""
        return self.holds_model or (self.known is not None and len(self.store.key_slot) >= len(self.known))

    def _resident(self):
        """The keys never to propose: resident ones, and (``known`` given) those that do not exist."""
        resident, known = self.store.resident, self.known
        if known is None:
            return resident
        p = self.predictor
        if self._all_known != (p.layers, p.experts):
            every = len(known) == p.layers * p.experts and all(
                (layer, e) in known for layer in range(p.layers) for e in range(p.experts))
            self._all_known = (p.layers, p.experts) if every else None
        return resident if self._all_known else _Resident(self.store.key_slot, known)

    def _allowance(self) -> float:
        """Expected unused reads the predictions may still spend: ``slack`` per read demand
        needed so far (misses, and predictions used: reads a miss would have made), less
        what the started ones are expected to waste."""
        demand = self.store.stats.misses + self.used_in_time + self.used_late
        return self.slack * demand - self.waste

    def _afford(self, props, allowance: float) -> list:
        """The proposals (best first) the read budget affords: each needs the allowance
        left to cover ``RESERVE`` times its expected waste (1 - confidence), and spends
        that waste.  When reads are plentiful anything the predictor proposes goes;
        as the allowance runs low, only the surest.  And the expected share used stays
        ``precision`` or more, counting every prediction started so far: a sure one
        (confidence above ``precision``) earns credit an unsure one may spend."""
        keys, credit = [], self.credit
        for key, c in props:
            if (1.0 - c) * RESERVE > allowance or credit + c - self.precision < 0:
                break
            allowance -= 1.0 - c
            credit += c - self.precision
            keys.append(key)
        return keys

    def end_token(self, client: int) -> None:
        """``client``'s token is over: the daemon's predictions for it go (demoted and
        counted when unused), and its next fetch begins a new pass."""
        self._release(client)
        n = self._tokens[client] = self._tokens.get(client, 0) + 1
        if n % self.skip:                        # the next token is skipped: no context carried over
            self._size[client] = self.predictor.fetch_size(client) or self._size.get(client, 0)
            self.predictor.forget(client)
        else:
            self.predictor.end_pass(client)

    def _judge(self) -> None:
        """Usefulness since the last judgement: back off (``skip`` doubles) below
        ``GAIN_POINTS`` used predictions per 100 keys fetched, else work on every token."""
        self._judged += 1
        if self._judged > WARM_UP:
            if self._used * 100 < GAIN_POINTS * self._keys:
                self.skip = min(MAX_SKIP, 2 * self.skip)
                self.backoffs += 1
            else:
                self.skip = 1
        self._keys //= 2                         # an average over judgements, the latest weighing most
        self._used //= 2
        self._judge_at = self._keys + JUDGE_KEYS

    def drop(self, client: int) -> None:
        self._release(client)
        self.predictor.forget(client)
        self._tokens.pop(client, None)
        self._size.pop(client, None)
        q = self.store.book.quality.pop(auto_id(client), None)
        if q is not None:
            for name in vars(q):
                setattr(self.gone, name, getattr(self.gone, name) + getattr(q, name))

    def _release(self, client: int) -> None:
        me = auto_id(client)
        self.store.end_epoch(me, None)
        for s in [s for s, o in self._out.items() if o[0] == client]:
            del self._out[s]

    def _room(self) -> int:
        """Slots a prediction may take now: free + evictable, less what every client's
        current token still needs (a client in a skipped token, which the predictor
        forgot: a whole pass of its last fetch size, as at a pass's start)."""
        st, p = self.store, self.predictor
        need = sum(p.remaining(c) for c in p.clients())
        if self.skip > 1:
            tokens = self._tokens
            need += p.layers * sum(k for c, k in self._size.items() if tokens.get(c, 0) % self.skip)
        return len(st.free) + st.policy.evictable() - need

    # -- figures ---------------------------------------------------------------------
    def totals(self) -> PredictionStats:
        """The daemon's predictions summed over clients (present and gone)."""
        out = PredictionStats()
        for c, q in [*self.store.book.quality.items(), (None, self.gone)]:
            if c is None or c < 0:
                for name in vars(q):
                    setattr(out, name, getattr(out, name) + getattr(q, name))
        return out

    def as_dict(self) -> dict:
        """For status and metrics: issued, used in time, used late, unused, refused, bytes read
        for nothing; what it cost: ``cpu_s`` over ``fetches`` (every fetch it saw); how far
        it backed off: ``skip`` (one token in this many worked on), ``backoffs``."""
        q = self.totals()
        return {"predictor": self.predictor.name, "issued": q.prefetched, "used": q.prefetch_hits,
                "used_in_time": self.used_in_time, "used_late": self.used_late,
                "unused": q.prefetch_unused, "unused_bytes": q.unused_bytes, "refused": q.refused,
                "precision": round(q.prefetch_hits / q.prefetched, 4) if q.prefetched else None,
                "fetches": self.fetches, "cpu_s": self.cpu_ns / 1e9,
                "skip": self.skip, "backoffs": self.backoffs, "holds_model": self.holds_model}


class _Resident:
    """``key in resident``: resident in the store, or not a key of the source."""

    __slots__ = ("key_slot", "known")

    def __init__(self, key_slot, known):
        self.key_slot, self.known = key_slot, known

    def __contains__(self, key) -> bool:
        return key in self.key_slot or key not in self.known
