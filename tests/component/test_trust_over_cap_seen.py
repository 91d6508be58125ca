"""A ``seen`` that arrives over the intake cap is not applied (``_refuse``: earlier reports
still wait); the client sends its count every heartbeat, so the next one lands and the
client does not lag (found by review: an honest paced client was named lagging)."""

from __future__ import annotations

import time

import pytest
import zmq
from test_intake_caps import attach, request, server  # noqa: F401  (fixture)

import k3client
from k3client.errors import SlotsBusy


def hello(ctx, endpoint):
    s, reply = attach(ctx, endpoint, "b", hit_path=True)
    return s, reply["client_id"]


@pytest.mark.parametrize("seen_first", [True, False])
def test_a_seen_over_the_cap_is_not_applied_and_the_next_one_is(server, seen_first):  # noqa: F811
    ctx = zmq.Context()
    b, bid = hello(ctx, server.cfg.endpoint)        # a hit-path client: its count is 0
    a = k3client.connect(server.cfg.endpoint, hit_path="daemon", timeout=1.0)
    try:
        a.fetch(0, list(range(16)))                  # the whole arena
        a.begin_token()
        with pytest.raises(SlotsBusy):
            a.fetch(1, [0])                          # a victim is evicted and waits for B
        reuse = server.store.reuse
        deadline = time.monotonic() + 10
        while not reuse.limbo and time.monotonic() < deadline:
            time.sleep(0.01)
        count = reuse.retired
        assert reuse.limbo and count >= 1
        n = 2000                                      # B's lease thread's seen among its flushes
        for i in range(n):
            last = i == (0 if seen_first else n - 1)
            b.send(request("hits", 100 + i, **({"seen": count} if last else {})))
        deadline = time.monotonic() + 10
        while server.stats.requests_over_cap == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)                              # every message handled
        assert server.stats.requests_over_cap > 0
        assert server.store.reuse.lagging(1e18) == [bid] or reuse.viewers[bid].synced >= count
        b.send(request("hits", 99999, seen=count))   # its lease thread's next beat (LocalHits.sync)
        time.sleep(0.5)
        assert reuse.viewers[bid].synced >= count, \
            f"B reported seen {count}; the daemon keeps {reuse.viewers[bid].synced} (lagging: {reuse.lagging(1e18)})"
    finally:
        a.close()
        b.close()
        ctx.term()
