"""SIGHUP: which settings a running daemon may change, and how they are applied.

``LIVE`` settings change at once (log level, lease for new clients, pin quota,
the pacing share, route trace: always reopened, so that logrotate's move starts a new file);
every other changed field is kept until a restart, with one warning naming
them.  A trace that cannot be opened keeps the old one (an error line).

The running values live in one ``k3d.config.Live`` object, which the store, the
pacer, the fetch service and the loop read at each use; ``apply`` writes them
there and nowhere else.

Thread: the server thread (the loop calls ``apply`` when the SIGHUP flag is set).
"""

from __future__ import annotations

import dataclasses
import logging
import time

from k3d.observe.trace import RouteTrace

log = logging.getLogger("k3d")

LIVE = ("log_level", "lease_s", "pin_quota", "max_share", "trace")   # what SIGHUP may change


def apply(cur, new, live, t0: float):
    """Apply ``new``'s LIVE settings over the running config ``cur``: into ``live`` (the
    ``k3d.config.Live`` every component reads them from), the route trace reopened (the
    old one closed) and the log level set.  Returns the config now running."""
    fixed = [f.name for f in dataclasses.fields(cur)
             if f.name not in LIVE and getattr(cur, f.name) != getattr(new, f.name)]
    trace = opened = live.trace
    if new.trace:
        try:   # always reopen: after logrotate moved the file, a new one starts
            opened = RouteTrace(new.trace, t0)
        except OSError as e:
            log.error("reload: cannot open trace %s (%s); keeping the old one", new.trace, e)
            new = dataclasses.replace(new, trace=cur.trace)
    else:
        opened = None
    if trace is not None and opened is not trace:
        trace.close()
    changed = [f"{n} {getattr(cur, n)!r} -> {getattr(new, n)!r}" for n in LIVE   # as applied
               if getattr(cur, n) != getattr(new, n)]
    logging.getLogger().setLevel(new.log_level.upper())
    running = dataclasses.replace(cur, **{n: getattr(new, n) for n in LIVE})
    live.take(running, opened)
    if fixed:
        log.warning("reload: %s only change on restart; keeping the running values", ", ".join(fixed))
    log.info("reloaded config: %s", ", ".join(changed) or "no live setting changed")
    return running


def run(cur, reloader, live, t0: float, notifier, status_line):
    """One SIGHUP: tell systemd (RELOADING, then READY with a status line), re-read the
    config through ``reloader`` (None: nothing to re-read) and ``apply`` it.  A config
    that fails to load keeps the running one, with an error line.  Returns the config now running."""
    if notifier is not None:
        notifier.send("RELOADING=1", f"MONOTONIC_USEC={time.monotonic_ns() // 1000}")
    try:
        new = reloader() if reloader else cur
    except Exception as e:  # noqa: BLE001 -- a bad file must not take a serving daemon down
        log.error("reload failed, keeping the running config: %s", e)
    else:
        cur = apply(cur, new, live, t0)
    if notifier is not None:
        notifier.send("READY=1", f"STATUS={status_line()}")
    return cur
