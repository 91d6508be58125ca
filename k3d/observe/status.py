"""The status a client or ``k3ctl status`` reads, and the one-line systemd STATUS.

Sections (memcached/Redis style: clients skip fields they do not know; new
sections may be added, existing fields keep their meaning):
- top: ``state`` (``serving``; the start-up responder says ``starting``), ``version``,
  ``protocol``, ``pid``, ``gen``, ``uptime_s``, ``endpoint``, ``model`` (the source's
  ``describe()``; ``model.digest`` is the content digest: ``rule``, ``hex``, ``parts``,
  ``cached``, ``bytes_read``, ``seconds``, or ``error``, or while it is computed after
  ready ``pending`` with ``done`` and ``total`` experts: ``k3d.sources.digest``);
- ``arena``: sizes, ``thp_bytes`` (in transparent huge pages so far), ``prepare`` (the
  collapse and pre-fault after ready: ``state`` ``running`` until ``done``, ``done`` and
  ``total`` bytes pre-faulted, ``seconds``: ``k3d.memory.prepare``), plus the store's
  gauges (``used``, ``pinned``, ``loading``, ``free``);
- ``stats``: the monotonic counters (``stats.Counters``, and ``replies_dropped``: replies
  ZeroMQ would not take, counted by ``wire.Replies``);
- ``fetch_seconds``: the fetch latency histogram by result (``latency.py``);
- ``readers``: threads, queued parts, held-back parts, throughput;
- ``reuse``: evicted slots waiting until no client can read them (``waiting``, its
  ``peak``), the ``reserve`` kept free while several clients answer hits themselves,
  and the clients that hold waiting slots (``held_by``: ``k3d/cache/reuse.py``);
- ``clients``: one entry per attached session, where its hits are answered
  (``hit_path``: ``client`` from the shared index, or ``daemon``), with its recent CPU share of the
  daemon (``cpu_share``), how often and how long it was held back (``pacing.py``), its
  requests waiting their turn (``queued``) and those refused over the cap (``over_cap``,
  ``serve/intake.py``), and ``step_pins``: over its ended epochs (``steps``), the most
  slots each had pinned for it at once (its pins and predictions), ``max``, ``median``,
  and the last 256 in order (``recent``);
- ``policy`` (its name), ``predict`` (auto, client or off), ``prediction``
  (quality in total, per client id, and the daemon's own predictions: ``quality.py``),
  ``warm`` (the state file and the warm restart's pre-load progress);
- ``source_changed``: one line per source file changed while served (empty while none
  is: ``k3d.sources.identity``); its experts not resident are no longer served.

Pure reads of the server's state: called on the server thread (``op_status``,
the loop's systemd status), never changes anything.
"""

from __future__ import annotations

import os

from k3client.protocol import PROTOCOL_VERSION
from k3d import __version__, compiled
from k3d.observe.quality import section as prediction_section


def build(srv, now: float) -> dict:
    """The status dict (``op_status``, ``k3ctl status --json``)."""
    st = srv.stats
    urgent, background = srv.reads.queued()
    pacer = srv.intake.pacer
    total_cpu = pacer.total(now)
    return {
        "state": "serving",
        "version": __version__,
        "build": compiled.status(),
        "protocol": PROTOCOL_VERSION,
        "pid": os.getpid(),
        "gen": srv.gen,
        "uptime_s": round(now - srv.t0, 3),
        "endpoint": srv.cfg.endpoint,
        "model": srv.source.describe(),
        "arena": {"bytes": srv.arena.size, "slots": srv.arena.slots,
                  "slot_bytes": srv.arena.slot_bytes, "expert_bytes": srv.source.expert_bytes,
                  "page_bytes": srv.arena.page_bytes,
                  "thp_bytes": srv.arena.thp_bytes, "prepare": srv.arena.prepare_status(),
                  **srv.store.gauges()},
        "stats": {**st.as_dict(), "replies_dropped": srv.replies.dropped},
        "policy": srv.cfg.policy,
        "predict": srv.cfg.predict,
        "prediction": prediction_section(srv.store, [s.client_id for s in srv.sessions], srv.cache.auto),
        "warm": srv.warm.status(srv.store),
        "source_changed": list(srv.cache.watch.changed.values()) if srv.cache.watch is not None else [],
        "fetch_seconds": srv.latency.as_dict(),
        "readers": {"threads": srv.reads.threads, "queued_urgent": urgent,
                    "queued_background": background,
                    "held_back": srv.reads.held_back(),
                    "busy_bps": round(st.bytes_read / st.read_seconds) if st.read_seconds else 0,
                    "recent_bps": round(srv.cache.recent.rate(now))},
        "reuse": {"waiting": len(srv.store.reuse.limbo), "peak": srv.store.reuse.peak,
                  "reserve": srv.store.reserve, "held_by": srv.store.reuse.holders()},
        "clients": [{"name": s.name, "id": s.client_id, "pid": s.pid, "epoch": s.epoch,
                     "hit_path": "client" if s.hit_path else "daemon",
                     "pins": srv.store.pins(s.holder), "step_pins": s.step_summary(), "fetches": s.fetches,
                     "idle_s": round(now - s.last_seen, 3),
                     "cpu_share": round(pacer.usage(s.client_id, now) / total_cpu, 4) if total_cpu else 0.0,
                     "paced": s.paced, "paced_s": round(s.paced_s, 3),
                     "queued": srv.intake.queued(s.routing), "over_cap": s.over_cap}
                    for s in srv.sessions],
    }


def line(srv) -> str:
    """One line for systemd's STATUS= (``systemctl status`` shows it)."""
    st = srv.stats
    total = st.hits + st.misses
    rate = f"{100 * st.hits / total:.1f}%" if total else "-"
    g = srv.store.gauges()
    return f"serving: {g['used']}/{srv.arena.slots} slots, hit rate {rate}, {len(srv.sessions)} clients"
