"""The store's half of the hit path: fetches a client answered itself, applied later.

A step ``Store.report_all`` (``k3d.cache.store``) runs: ``apply`` gets the
store's parts it reads or changes as explicit arguments (the slot maps, read
only; the policy, ``reuse``, the ``PredictionBook`` and the ``Counters``,
changed); it keeps no state of its own.  Kept apart because it
is one concern and the one per-hit cost left in the daemon: every access a client
answers from the shared index reaches the policy here, in the order the client
made it.

A report is ``(keys, seen)``: one fetch's keys, all of one layer (``wire.hits``
builds them so), and the slots the client saw them in.  A key still READY in
the slot it was seen in counts as the hit of a fetch: the policy hears the
layer's visit and the touch in the same order as for a fetch, prediction
accounting alike, and the slot is pinned for the client's epoch.  A key that has
left that slot since (a late report) is claimed instead: its slot is not reused
before the client's next token (``reuse``).  Nothing is read.

Refused (not heard, pinned or claimed; counted in ``bad_reports``): a slot the
client could not have read in its window (``Reuse.claimable``: not waiting for
reuse, or retired before the client's sync point), and, with a pin quota, a
slot beyond the quota the client was told at hello, claims counting toward it
(``k3client`` answers no more itself).  So a client's reports can keep from
reuse only slots it could really have read, and no more than its quota.

Batching, and why it changes nothing: ``apply`` applies a request's reports
in one call.  Between two reports of one request nothing chooses a victim (a
report never evicts, and the daemon's predictor only learns from it), and pins
only ever matter to a victim choice; so the pins of all the reports can be taken
once, after their visits and touches, and victims, counters and the route trace
are those of one ``report`` per fetch.  When the same request then ends the
client's epoch (``begin_token``) and there is no pin quota, ``pin=False`` takes
no pins at all: they would be released before anything could see them.  The
count of pins released stays what it would have been (``released``).

Thread: the server thread, as the store.
"""

from __future__ import annotations

READY = "ready"          # (the store's; a literal here so that this step imports nothing back)


def apply(holder, reports, pin: bool, quota: int, *, key_slot: dict, state: list, loads: dict,
          policy, reuse, book, stats) -> tuple[list[int], int]:
    """Apply ``reports`` (``[(keys, slots seen), ...]``, in the order the client
    answered them) for ``holder`` (client, epoch).  ``pin`` False: the caller ends
    ``holder``'s epoch next, with nothing in between (see the module docstring).
    ``quota``: the pin quota ``holder``'s client was told (0: none).  ``key_slot``,
    ``state``, ``loads``: the store's slot maps; ``policy``, ``reuse``, ``book``
    (``PredictionBook``), ``stats`` (``Counters``): the store's, told what the reports did.
    Returns (per report, how many of its keys were predicted slots it used; the
    pins not taken because of ``pin`` False, which ending the epoch would have released)."""
    client = holder[0]
    where, predicted = key_slot.get, book.predicted_by
    heard, pins = [], []
    n = late = 0
    for keys, seen in reports:
        m = len(keys)
        n += m
        layer = keys[0][0]
        # A key's slot is READY unless it is loading (the store's invariant): the
        # common case is checked by two calls for the whole report.
        if list(map(where, keys)) != seen or (loads and not loads.keys().isdisjoint(seen)):
            keys, seen = _not_late(holder, keys, seen, quota, key_slot, state, policy, reuse, stats)
            late += m - len(keys)
        heard.append((layer, keys, seen))
        pins += seen
    policy.hear_all(heard)
    if predicted:
        used = [sum(book.used(s) for s in seen if s in predicted) for _, _, seen in heard]
    else:
        used = [0] * len(heard)
    skipped = 0
    if quota:                                   # (``pin`` False is for no quota only)
        claims = reuse.claims(client)
        for s in pins:
            held = policy.held(holder)
            if s not in held and len(held) + len(claims) >= quota:
                stats.bad_reports += 1
            else:
                policy.pin(s, holder)
    elif pin:
        policy.pin_all(pins, holder)
    else:
        held = policy.held(holder)
        skipped = len(set(pins).difference(held))
    stats.fetches += len(reports)
    stats.hits += n
    stats.client_hits += n
    stats.late_hits += late
    stats.prefetch_hits += sum(used)
    book.client_quality(client).ready += n
    return used, skipped


def _not_late(holder, keys, seen, quota: int, key_slot, state, policy, reuse, stats) -> tuple[list, list]:
    """``keys`` and ``seen`` less the keys no longer READY in the slot seen, whose
    slots are claimed until ``client``'s next token (refused and counted when it
    could not have read them)."""
    good_k, good_s = [], []
    client = holder[0]
    claims = reuse.claims(client)
    for key, s in zip(keys, seen):
        if key_slot.get(key) == s and state[s] == READY:
            good_k.append(key)
            good_s.append(s)
        elif quota and s not in claims and len(policy.held(holder)) + len(claims) >= quota:
            stats.bad_reports += 1
        elif not reuse.claim(client, s, key[0]):
            stats.bad_reports += 1
        claims = reuse.claims(client)
    return good_k, good_s
