"""Start-up and shutdown of ``k3d start``: source, arena, sockets, signals.

Order: open and validate the source (so a bad checkpoint fails before any
memory is taken), size the arena, refuse to steal the endpoint of a live
daemon (a stale socket left by ``kill -9`` is removed), collapse what the
kernel has free 2 MiB blocks for into transparent huge pages (unless
``--no-thp``/``--hugepages``), reserve every page of the arena, bind, then
print ``ready`` and tell systemd READY=1; only then does the arena's preparer
thread collapse the rest and pre-fault it while the loop serves
(``k3d.memory.prepare``; status ``arena.prepare`` says how far), and the
content digest, unless cached, is computed (``k3d.sources.digest.AfterReady``;
``model.digest`` is ``pending`` until it is done).

Signal handlers only ask the loop to act (gunicorn's arbiter rule): SIGTERM/
SIGINT to stop (the loop drains and returns, ``run`` releases the arena and
exits 0), SIGHUP to reload the config (``reload`` re-resolves it).  The stop
handlers are installed first of all: a stop during start-up (a long reservation)
ends it at the next progress tick, releasing what was built, with exit 0.
One daemon per endpoint: ``claim_endpoint`` (``k3d.service.claim``) flocks
``ARENA_SOCK.lock`` for the daemon's life, so a second start is refused even
before the first answers; every exit, a failed start included, releases it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import time

import psutil
import zmq

from k3client.endpoint import arena_socket_for, ipc_path
from k3client.layout import align
from k3d import compiled
from k3d.memory.arena import PAGE, Arena, ArenaError, hugepages, memfd_bytes
from k3d.observe.metrics import Exporter, SnapshotBoard
from k3d.serve.loop import Server
from k3d.serve.wire import open_endpoint
from k3d.sizes import show_size

from ..reads.plan import readers_for
from ..sources import SourceError, open_source
from ..sources.digest import AfterReady as DigestAfterReady, cached as cached_digest, threads_for as digest_threads
from . import collector
from .claim import claim_endpoint
from .notify import Notifier
from .sizing import arena_warnings
from .starting import Progress, ProgressPrinter, StartupError, StartupResponder, describe

log = logging.getLogger("k3d")


def cgroup_memory_room() -> tuple[int, int, str] | None:
    """(bytes left, limit, cgroup dir) of the tightest memory cgroup limit above us.

    The arena's pages are charged to the daemon's cgroup (systemd's MemoryMax=),
    and a posix_fallocate past that limit gets the process OOM-killed instead of
    an error, so the limit is checked before reserving.  Usage counts the
    working set (inactive page cache is reclaimable).  None: no limit found."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    best = None
    for line in lines:
        hid, ctrls, path = line.split(":", 2)
        if hid == "0" and ctrls == "":
            base, names = "/sys/fs/cgroup", ("memory.max", "memory.current", "inactive_file")
        elif "memory" in ctrls.split(","):
            base, names = "/sys/fs/cgroup/memory", ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                                    "total_inactive_file")
        else:
            continue
        while True:
            d = os.path.normpath(base + "/" + path)
            try:
                with open(os.path.join(d, names[0])) as f:
                    limit = f.read().strip()
                if limit != "max" and int(limit) < 2**60:
                    with open(os.path.join(d, names[1])) as f:
                        usage = int(f.read())
                    with open(os.path.join(d, "memory.stat")) as f:
                        stat = dict(l.split() for l in f if l.strip())
                    usage -= int(stat.get(names[2], 0))
                    if best is None or int(limit) - usage < best[0]:
                        best = (int(limit) - usage, int(limit), d)
            except (OSError, ValueError):
                pass
            if path in ("/", ""):
                break
            path = os.path.dirname(path)
    return best


def size_arena(cfg, expert_bytes: int) -> tuple[int, int]:
    """(slots, slot_bytes) for the config; StartupError if it cannot fit."""
    slot_bytes = align(max(expert_bytes, 1), PAGE)
    slots = cfg.slots or cfg.arena // slot_bytes
    if slots < 1:
        raise StartupError(f"arena of {cfg.arena} bytes is smaller than one slot ({slot_bytes} bytes per expert); "
                           "raise --arena")
    size = memfd_bytes(slots * slot_bytes, cfg.hugepages, cfg.thp)    # what will be reserved
    if cfg.hugepages:
        # hugetlb pages come from the reserved pool, not from available memory or the cgroup
        page, free = hugepages()
        if not page:
            raise StartupError("--hugepages: this kernel has no huge pages")
        need = -(-size // page)
        if need > free:
            raise StartupError(f"--hugepages: the arena of {show_size(size)} ({slots} slots) needs {need} "
                               f"huge pages of {show_size(page)}, {free} are free; raise vm.nr_hugepages "
                               "(sysctl) or lower --arena")
        return slots, slot_bytes
    avail = psutil.virtual_memory().available
    if size > avail:
        raise StartupError(f"arena of {show_size(size)} ({slots} slots) exceeds available memory "
                           f"{show_size(avail)}; lower --arena")
    room = cgroup_memory_room()
    if room is not None and size + 16 * 2**20 > room[0]:   # + Python, readers, buffers
        raise StartupError(f"arena of {show_size(size)} ({slots} slots) does not fit the memory cgroup "
                           f"{room[2]}: {show_size(max(room[0], 0))} left of its {show_size(room[1])} "
                           "limit (systemd: MemoryMax=); raise the limit or lower --arena")
    return slots, slot_bytes


# What the arena's progress steps are called where a person reads them.
PHASES = {"collapsing": "collapsing the arena into huge pages", "reserving": "reserving the arena"}


class _StopDuringStartup(Exception):
    """SIGTERM/SIGINT arrived before the server loop ran: stop cleanly (exit 0)."""


def run(cfg, env, reload=None) -> int:
    # Stop requests are honoured from the first instruction: during a long arena reservation
    # a SIGTERM (systemctl stop) must end the start-up cleanly, not kill it by default.
    stop = {"requested": False, "server": None}

    def on_stop(*_):
        stop["requested"] = True
        if stop["server"] is not None:
            stop["server"].request_stop()

    def check_stop():
        if stop["requested"]:
            raise _StopDuringStartup()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_stop)
    try:
        return _run(cfg, env, reload, stop, check_stop)
    except _StopDuringStartup:
        log.info("stopped during start-up")
        return 0


def _run(cfg, env, reload, stop, check_stop) -> int:
    notifier = Notifier(env)
    if not cfg.source:
        raise StartupError("no checkpoint: pass --source PATH (or set source in the config file / K3D_SOURCE)")
    if cfg.trace:                        # before anything is built: a typo must not cost a reservation
        try:
            open(cfg.trace, "a").close()
        except OSError as e:
            raise StartupError(f"cannot open the route trace {cfg.trace}: {e.strerror}") from None
    source = arena = server = lock = exporter = responder = digester = None
    try:
        arena_sock = arena_socket_for(cfg.endpoint, env)
        lock = claim_endpoint(cfg.endpoint, arena_sock)
        # From here the endpoint answers status (phase, progress, ETA) and refuses the rest
        # with `starting` until the server loop takes the socket over.
        progress = Progress()
        try:
            responder = StartupResponder(open_endpoint(zmq.Context(), cfg.endpoint), cfg.endpoint, progress)
        except zmq.ZMQError as e:
            raise StartupError(f"cannot bind {cfg.endpoint}: {e}") from None
        board = SnapshotBoard()
        board.publish(responder.status())
        if cfg.metrics:                  # before the arena: a port in use must not cost a reservation
            try:
                exporter = Exporter(cfg.metrics, board)
            except RuntimeError as e:
                raise StartupError(str(e)) from None
            log.info("metrics at http://%s/metrics", exporter.address)
        try:
            source = open_source(cfg.source, cfg.pattern, cfg.read_mode, cfg=cfg)
        except SourceError as e:
            raise StartupError(str(e)) from None
        check_stop()
        progress.update("sizing the arena", 0, 0)
        chosen = "" if cfg.readers else f" (chosen for {source.kind} reads on {os.cpu_count()} CPUs)"
        cfg = with_readers(cfg, source)
        slots, slot_bytes = size_arena(cfg, source.expert_bytes)
        for warning in arena_warnings(slots, slot_bytes, source.describe()):
            log.warning("%s", warning)
        log.info("source %s: %d experts, %d bytes each; arena %d slots x %d bytes; %d readers%s",
                 source.path, len(source.keys), source.expert_bytes, slots, slot_bytes, cfg.readers, chosen)
        arena = build_arena(cfg, slots, slot_bytes, progress, notifier, check_stop,
                            lambda: board.publish(responder.status()))
        # a cached digest now (before any client); one to compute once serving (k3d.sources.digest)
        source.digest = cached_digest(source, cfg.state_dir)
        if source.digest is None:
            digester = DigestAfterReady(source, cfg.state_dir, digest_threads(source, cfg.readers))
        try:
            server = Server(cfg, source, arena, arena_sock, notifier, board, sock=responder.hand_over())
        except zmq.ZMQError as e:
            raise StartupError(f"cannot bind {cfg.endpoint}: {e}") from None
        except OSError as e:
            raise StartupError(f"cannot start serving at {cfg.endpoint}: {e}") from None
        responder = None
        stop["server"] = server
        if stop["requested"]:            # came while binding: the loop shuts down at once, cleanly
            server.request_stop()
        server.reloader = (lambda: with_readers(reload(), source)) if reload else None
        signal.signal(signal.SIGHUP, lambda *_: server.request_reload())
        print(f"k3d: ready endpoint={cfg.endpoint} slots={slots} slot_bytes={slot_bytes} "
              f"experts={len(source.keys)} pid={os.getpid()} build={compiled.status().split()[0]} "
              f"in {progress.snapshot()['uptime_s']:.1f}s",
              file=sys.stderr, flush=True)
        notifier.ready(server.status_line())
        if digester is not None:
            digester.start()
        arena.prepare(on_done=lambda p: (log.info if p.state == "done" else log.warning)("arena: %s", p.outcome()))
        collector.settle()               # start-up's objects leave the collector's scans
        server.serve_forever()
        log.info("stopped")
        return 0
    finally:
        if responder is not None:        # start-up failed or was stopped: the endpoint goes too
            sock = responder.hand_over()
            ctx = sock.context
            sock.close(0)
            ctx.term()
            path = ipc_path(cfg.endpoint)
            if path and os.path.exists(path):
                os.unlink(path)
        if exporter is not None:
            exporter.stop()
        if arena is not None:
            arena.close()
        if digester is not None:
            digester.stop()              # before the source closes: it reads the source
        if source is not None and (server is None or not server.reads.readers_alive()):
            source.close()               # (a stuck reader may still use the fds)
        notifier.close()
        if lock is not None:
            lock.release()


def with_readers(cfg, source):
    """``readers`` left to the daemon: chosen for this source's read path."""
    return cfg if cfg.readers else dataclasses.replace(cfg, readers=readers_for(source.kind, os.cpu_count()))


def build_arena(cfg, slots: int, slot_bytes: int, progress, notifier, check_stop, publish) -> Arena:
    """The arena, with its progress shown (stderr, status, systemd STATUS=) as it is prepared."""
    printer = ProgressPrinter()
    t0 = time.monotonic()

    def tick(done, total, seconds, what):
        check_stop()
        p = progress.update(PHASES.get(what, what), done, total)
        printer.show(p)
        publish()                        # /metrics shows the start-up too
        notifier.status(f"starting: {describe(p)}")
        if notifier.watchdog_interval:   # a long reservation is not a hang
            notifier.watchdog()
    try:
        arena = Arena(slots, slot_bytes, progress=tick, huge=cfg.hugepages, thp=cfg.thp)
    except ArenaError as e:
        raise StartupError(str(e)) from None
    check_stop()
    if cfg.thp and not cfg.hugepages:
        log.info("arena: %d of %d MiB in transparent huge pages, reserved in %.1fs; the rest is collapsed and "
                 "the arena pre-faulted after ready (huge pages make O_DIRECT/disk reads into the arena faster; "
                 "--no-thp skips them)", arena.thp_bytes >> 20, arena.mapped >> 20, time.monotonic() - t0)
    return arena
