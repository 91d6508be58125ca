"""An interrupted request's reports are never lost to the lease thread (the real client, the real loop).

A KeyboardInterrupt after the client took its hit reports and before it sent them,
and the lease thread sending the index count in between: the reports must go
before that count, or the daemon reuses slots the client still holds views of
(found by review: slot 0 was rewritten under B's view)."""

from __future__ import annotations

import threading
import time

import pytest

import k3client
from k3client.errors import SlotsBusy
from servers import Servers


@pytest.fixture
def server(checkpoint):
    servers = Servers(checkpoint, prefix="k3d-lost-")
    yield servers.start(lease_s=120)          # a long lease: the lease thread beats only when told
    servers.close()


def image(e, layout):
    return b"".join(e.array(spec.name).tobytes() for spec in layout)


def test_lease_sync_between_take_and_failed_loses_reports_and_a_view_is_rewritten(server):
    """B answers 8 hits itself; Ctrl-C in its next request after take(); its lease thread
    takes _io before _call's ``hits.failed()``: the reports are lost, the seen goes, and
    A's misses rewrite a slot B still holds a view of."""
    a = k3client.connect(server.cfg.endpoint, hit_path="daemon", timeout=5.0)
    b = k3client.connect(server.cfg.endpoint, hit_path="client", timeout=5.0)
    try:
        a.fetch(0, list(range(16)))             # the whole arena, then unpinned
        a.begin_token()
        time.sleep(0.2)                          # (B's first beat, at attach, has gone)
        views = b.fetch(0, list(range(8)))      # half the slots: answered by B itself
        assert b._hits.reports
        before = [image(v, b.layout) for v in views]
        a.timeout = 0.05
        with pytest.raises(SlotsBusy):
            a.fetch(1, [0])                      # the count moves: a victim waits for B
        a.timeout = 5.0
        real_post, real_failed = b._chan.post, b._hits.failed

        def post(op, **fields):                  # Ctrl-C after take(), before the send
            b._chan.post = real_post
            raise KeyboardInterrupt

        def failed():                            # the lease thread wins _io just before this
            t = threading.Thread(target=b._lease_sync)
            t.start()
            t.join()
            real_failed()
        b._chan.post, b._hits.failed = post, failed
        with pytest.raises(KeyboardInterrupt):
            b.status()
        b._hits.failed = real_failed
        stop = threading.Event()

        def lease():                             # B's lease thread, beating often
            while not stop.wait(0.01):
                b._lease_sync()
        t = threading.Thread(target=lease)
        t.start()
        try:
            for layer in (1, 2, 3):              # A's misses: every slot turns over
                for e in range(16):
                    a.fetch(layer, [e])
                    a.begin_token()
        finally:
            stop.set()
            t.join()
        rewritten = [v.slot for v, old in zip(views, before) if image(v, b.layout) != old]
        assert not rewritten, f"B's views of slots {rewritten} were rewritten under it"
    finally:
        a.close()
        b.close()
