"""Client sessions: who is attached, and whether they are still alive.

A ``Session`` is one attached client (one DEALER socket's routing id), made
by ``hello`` and ended by ``bye``, a second ``hello``, or the reaper.  Its
``holder`` (client id, epoch) names the pins of its current token.

Liveness (``Sessions.expired``, asked every ``REAP_INTERVAL`` by the loop):
- process: the pid (from the ipc peer credentials, else what hello claims) and
  its start time in clock ticks since boot (``start_ticks``); a pid that is gone,
  a zombie, or now another process (reused: other start ticks) is dead;
- lease: a client silent (no request, no heartbeat) for longer than its lease
  is dead too (a process alive but stuck, or a client over tcp without a pid).
This module only judges; the server drops a dead session (pins, reads, waiters).

Thread: the server thread owns the registry; no locking.
"""

from __future__ import annotations

import logging
from collections import deque

log = logging.getLogger("k3d")

REAP_INTERVAL = 0.5      # seconds between liveness checks
RECENT_STEPS = 256       # ended epochs whose pin peaks status lists in order (``step_pins.recent``)


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (/proc/PID/stat field 22);
    None if it is gone or a zombie (exited, not yet reaped).  Read by hand because
    psutil's ``create_time()`` is wall-clock time (boot time + ticks): a clock step (NTP,
    settimeofday) would move it, and every live client would then look like a reused pid
    and lose its pins.

    Any other OSError (EMFILE while fds run out) is raised: it says nothing about the
    process, and reading it as "gone" would drop a live client's pins."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    try:
        fields = stat[stat.rindex(b")") + 2:].split()     # fields from 3 (state) on, after "(comm) "
        return None if fields[0] == b"Z" else int(fields[19])
    except (ValueError, IndexError):
        return None


class Session:
    """One attached client: identity (pid + start ticks), epoch, lease, prediction throttle state."""

    __slots__ = (
        "alive",
        "client_id",
        "epoch",
        "fetches",
        "hit_path",
        "last_seen",
        "lease_s",
        "name",
        "over_cap",
        "paced",
        "paced_s",
        "pin_quota",
        "unbilled",
        "pf_started",
        "pf_waste",
        "unused_predictions",
        "pid",
        "routing",
        "started",
        "step_peak",
        "step_pins",
        "step_recent",
    )

    def __init__(self, routing, client_id, name, pid, started, now, lease_s=0.0):
        self.routing, self.client_id, self.name = routing, client_id, name
        self.pid, self.started = pid, started
        self.epoch, self.last_seen, self.unused_predictions, self.alive, self.fetches = 0, now, 0, True, 0
        self.hit_path = False      # answers hits itself from the shared index (k3d/cache/reuse.py)
        # The lease told to the client at hello: it heartbeats at a quarter of it,
        # so a reload that shortens the lease applies to new clients only.
        self.lease_s = lease_s
        self.pin_quota = 0         # the quota told at hello: its reports are judged by it (cache/reported.py)
        # Background reads this client started this epoch, and the moving share
        # of its predictions nobody fetched (the quota's prediction throttle).
        self.pf_started, self.pf_waste = 0, 0.0
        # Pacing (k3d/serve/pacing.py): how often it was held back, for how long in all (the hold
        # itself lives in the loop's turns: ``Turns.held_until``).
        self.paced, self.paced_s = 0, 0.0
        self.unbilled = 0.0        # CPU seconds spent for it that the pacer has not been told yet
        self.over_cap = 0          # requests refused: it had wire.MAX_QUEUED waiting (k3d/serve/intake.py)
        # Slots pinned for it (its epoch's and its predictions') at most so far this epoch; per
        # ended epoch, how many ended with each peak, and the last RECENT_STEPS peaks in order
        # (status ``step_pins``; cache/fetch.py)
        self.step_peak = 0
        self.step_pins: dict[int, int] = {}
        self.step_recent: deque[int] = deque(maxlen=RECENT_STEPS)

    def end_step(self) -> None:
        """Its epoch ended: its peak goes into ``step_pins`` and ``step_recent``."""
        self.step_pins[self.step_peak] = self.step_pins.get(self.step_peak, 0) + 1
        self.step_recent.append(self.step_peak)
        self.step_peak = 0

    def step_summary(self) -> dict:
        """``{steps, max, median, recent}`` of the pins its ended epochs peaked at (status;
        ``recent``: the last ``RECENT_STEPS`` in order)."""
        n = sum(self.step_pins.values())
        if not n:
            return {"steps": 0, "max": 0, "median": 0, "recent": []}
        seen, median = 0, 0
        for peak in sorted(self.step_pins):
            seen += self.step_pins[peak]
            if 2 * seen >= n:
                median = peak
                break
        return {"steps": n, "max": max(self.step_pins), "median": median, "recent": list(self.step_recent)}

    @property
    def holder(self):
        return (self.client_id, self.epoch)


def identify(pid: int | None) -> tuple[int | None, int | None]:
    """(pid, start ticks) to watch for a client claiming ``pid``; (None, None) when
    it cannot be watched (no pid, gone, or unreadable now): the lease alone applies."""
    if pid is None:
        return None, None
    try:
        started = start_ticks(pid)
    except OSError:
        started = None
    return (pid, started) if started is not None else (None, None)


class Sessions:
    """The attached clients, by routing id (the socket) and by client id (heartbeats)."""

    def __init__(self):
        self.by_routing: dict[bytes, Session] = {}
        self.by_id: dict[int, Session] = {}
        self._next_client = 1

    def __len__(self) -> int:
        return len(self.by_routing)

    def __iter__(self):
        return iter(list(self.by_routing.values()))

    def get(self, routing: bytes) -> Session | None:
        return self.by_routing.get(routing)

    def attach(self, routing: bytes, name: str, pid, started, now: float, lease_s: float) -> Session:
        s = Session(routing, self._next_client, name, pid, started, now, lease_s)
        self._next_client += 1
        self.by_routing[routing] = s
        self.by_id[s.client_id] = s
        return s

    def remove(self, s: Session) -> None:
        s.alive = False
        self.by_routing.pop(s.routing, None)
        self.by_id.pop(s.client_id, None)

    def heartbeat(self, client_id, sender_pid, now: float) -> bool:
        """Renew ``client_id``'s lease if the sender owns it (its pid, where the peer
        credentials say it: ipc); False when it renewed nothing."""
        s = self.by_id.get(client_id) if type(client_id) is int else None
        if s is None or (sender_pid is not None and s.pid is not None and sender_pid != s.pid):
            return False
        s.last_seen = now
        return True

    def expired(self, now: float, lease_s: float) -> list[tuple[Session, str]]:
        """Sessions whose process is gone or whose lease ran out, with the reason."""
        out = []
        for s in self:
            reason = None
            if s.pid is not None:
                try:
                    ticks = start_ticks(s.pid)
                except OSError as e:      # cannot tell now (fds exhausted): ask again next round
                    log.debug("liveness of pid %s unknown: %s", s.pid, e)
                    continue
                if ticks is None:
                    reason = "exited"
                elif ticks != s.started:
                    reason = "exited (pid reused)"
            lease = max(lease_s, s.lease_s)
            if reason is None and now - s.last_seen > lease:
                reason = f"silent for {now - s.last_seen:.1f}s (lease {lease:g}s)"
            if reason:
                out.append((s, reason))
        return out
