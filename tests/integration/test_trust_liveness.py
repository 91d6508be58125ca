"""Honest clients never hold other clients' misses back (real daemons, 4-slot arenas, lease 1 s).

A hit-path client's sync point must keep passing the daemon's retirement count
(``k3d/cache/reuse.py``), or every eviction waits for it.  Two ways an honest
client once stopped it, found by review:
- one failed read (an origin answering 404) moved the count clients read in the
  index but not the daemon's own, so an idle client's ``seen`` was refused as
  garbage and its sync point never moved;
- a client that could not map the index fell back to the daemon hit path after
  telling the daemon, in ``hello``, that it would read it.
In both, another client's misses must all complete, and no honest report is refused.
"""

from __future__ import annotations

import pytest
from test_trust_views import origin  # noqa: F401 -- the fixture: a checkpoint behind a faulty HTTP origin

import k3client
import k3client.attachment as client_mod
from faulty_http import Fault


def _eight_misses(a) -> int:
    done = 0
    for i in range(8):
        a.begin_token()
        a.fetch(1 + i % 2, [i])
        done += 1
    return done


def test_misses_complete_after_a_failed_read_with_an_idle_reader(origin, start_daemon):  # noqa: F811
    srv, _ = origin
    d = start_daemon(srv.url + "ck/", "--slots", "4", "--lease", "1", "--predict", "client",
                     "--policy", "lru", "--http-timeout", "5")
    with k3client.connect(d.endpoint, name="a", timeout=5) as a, \
            k3client.connect(d.endpoint, name="b", timeout=5) as b:
        assert b.hit_path == "client"
        srv.add(Fault("status", times=None, status=404))
        with pytest.raises(k3client.K3Error):
            a.fetch(0, [0])                     # one read fails: its LOADING entry is cleared
        srv.clear()
        b.fetch(3, [0])
        b.begin_token()                         # then B is idle; its lease thread reports
        assert _eight_misses(a) == 8
        st = a.status()["stats"]
        assert st["bad_reports"] == 0 and st["errors"] == 1


def test_a_client_that_fell_back_to_daemon_mode_does_not_stall_others(checkpoint, start_daemon, monkeypatch):
    d = start_daemon(checkpoint, "--slots", "4", "--lease", "1", "--predict", "client", "--policy", "lru")

    def no_index(*a, **k):
        raise OSError(12, "Cannot allocate memory")     # mmap refused (vm.max_map_count): not to be had here

    with k3client.connect(d.endpoint, name="a", timeout=5) as a:
        monkeypatch.setattr(client_mod, "LocalHits", no_index)
        with k3client.connect(d.endpoint, name="b", timeout=5) as b:
            monkeypatch.undo()
            assert b.hit_path == "daemon", b.hit_path_why
            b.fetch(0, [0])
            b.begin_token()                     # then idle
            assert _eight_misses(a) == 8
            assert [c["hit_path"] for c in a.status()["clients"] if c["name"] == "b"] == ["daemon"]
