"""systemd units for k3d, embedded so that an installed package can write them.

``k3d install-unit`` renders three files:

- ``k3d.service``: one daemon per host.  Type=notify (the daemon sends READY=1
  once the arena is mapped and both sockets are bound, STATUS= lines, WATCHDOG=1
  at half of WatchdogSec, STOPPING=1 when it drains), a fixed system user
  ``k3d``, config ``/etc/k3d/k3d.toml``, sockets in ``/run/k3d`` (0750, sockets
  0660: the daemon's user and group only).
- ``k3d@.service``: one daemon per model, ``systemctl start k3d@gpt-oss``:
  config ``/etc/k3d/%i.toml``, sockets in ``/run/k3d/%i``.
- ``k3d.sysusers.conf``: the ``k3d`` user and group for systemd-sysusers.

Why the settings are what they are (each pitfall was checked):
- The arena's shared-memory pages are charged to the unit's cgroup, so
  ``MemoryMax`` is the arena plus headroom (``--arena`` here, or the config
  file's ``arena``; a config that sizes by ``slots`` needs ``--arena``).
- ``k3d.service`` keeps ``/run/k3d`` when it stops (``RuntimeDirectoryPreserve``):
  the ``k3d@MODEL`` instances have their sockets below it, in ``/run/k3d/MODEL``.
- Paths the daemon writes (``trace``, ``disk_cache``) must be under the
  StateDirectory ``/var/lib/k3d`` (or its private /tmp): the rest of the file
  system is read-only to it (``ProtectSystem=strict``).  The warm-restart
  statistics go there by default: systemd sets ``$STATE_DIRECTORY`` and
  ``k3d.config`` prefers it to the XDG state directory.
- ``RemoveIPC=yes`` and ``DynamicUser=yes`` delete the user's POSIX shared
  memory and IPC objects when the unit stops: both stay off, with a fixed user.
- The hardening keeps /dev/shm writable (``ProtectSystem=strict`` leaves /dev
  alone; ``PrivateDevices`` keeps the host's /dev/shm) and keeps /proc fully
  visible: the daemon checks client liveness and groups in /proc/<pid>, so
  ``ProtectProc=invisible`` or ``ProcSubset=pid`` would make every client of
  another user look dead.
- ``PrivateTmp=yes`` gives the service empty /tmp and /var/tmp of its own, and
  /root is closed to other users: ``install-unit`` warns of an ExecStart there.
- Clients find the daemon through ``K3D_ENDPOINT`` (set in the unit for the
  daemon; model processes need the same value) and must be in group ``k3d``.

Pure text rendering; ``install`` is the only function that writes files.  Run by
``k3d install-unit`` in the CLI's one thread.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys

from ..config import Config, ConfigError, load_file, parse_size

HEADROOM = 2 * 2**30         # Python, reader threads, page cache of the source

_COMMON = """\
Type=notify
NotifyAccess=main
User=k3d
Group=k3d
ExecReload=/bin/kill -HUP $MAINPID
UMask=0007
Restart=on-failure
RestartSec=1
# Pre-faulting a large arena takes about 1 s per GB on a slow VM.
TimeoutStartSec=15min
TimeoutStopSec=60
WatchdogSec=30
# The arena's shared memory is charged to this unit: arena {arena} + headroom.
MemoryMax={memory_max}
LimitNOFILE=65536
# No RemoveIPC=yes and no DynamicUser=yes: both delete the user's shared memory
# and IPC objects when the unit stops.  A fixed system user instead.
RemoveIPC=no
# Hardening.  /dev/shm stays shared and writable (ProtectSystem=strict leaves
# /dev alone); /proc stays fully visible (no ProtectProc=/ProcSubset=): the
# daemon reads /proc/<pid> of its clients for liveness and group checks.
NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=read-only
ReadWritePaths=-/dev/shm
PrivateTmp=yes
PrivateDevices=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
RestrictNamespaces=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
LockPersonality=yes
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6
SystemCallArchitectures=native
CapabilityBoundingSet=
AmbientCapabilities=
"""

_SERVICE = """\
# k3d: shared expert-weight cache for MoE inference, one daemon per host.
# Written by `k3d install-unit`.  Model processes: be in group k3d and set
# K3D_ENDPOINT=ipc:///run/k3d/k3d.sock and K3D_DAEMON_GROUP=k3d (they trust a
# daemon of that group).  Reload live settings: systemctl reload k3d.
[Unit]
Description=k3d shared expert-weight cache
After=local-fs.target network-online.target
Wants=network-online.target

[Service]
ExecStart={exec} start --config /etc/k3d/k3d.toml
# The socket lives in the RuntimeDirectory (0750, owned by k3d); the
# environment wins over the config file's endpoint.
Environment=K3D_ENDPOINT=ipc:///run/k3d/k3d.sock
# Prometheus /metrics (needs prometheus_client: pip install 'k3d-expert-cache[metrics]').  To move
# or turn it off: systemctl edit k3d, [Service] Environment=K3D_METRICS=HOST:PORT (or "").
Environment=K3D_METRICS=127.0.0.1:9484
RuntimeDirectory=k3d
RuntimeDirectoryMode=0750
# Kept when this unit stops: k3d@MODEL instances have their sockets below it.
RuntimeDirectoryPreserve=yes
# The policy's statistics (warm restart) live in $STATE_DIRECTORY, which k3d reads.
StateDirectory=k3d
StateDirectoryMode=0750
{common}
[Install]
WantedBy=multi-user.target
"""

_TEMPLATE = """\
# k3d@MODEL: one k3d daemon per model (systemctl enable --now k3d@MODEL).
# Written by `k3d install-unit`.  Config /etc/k3d/MODEL.toml; model processes:
# be in group k3d and set K3D_ENDPOINT=ipc:///run/k3d/MODEL/k3d.sock and
# K3D_DAEMON_GROUP=k3d.
# MemoryMax below applies to each instance; size one per model with
# `systemctl edit k3d@MODEL` ([Service] MemoryMax=...).
[Unit]
Description=k3d shared expert-weight cache for %i
After=local-fs.target network-online.target
Wants=network-online.target

[Service]
ExecStart={exec} start --config /etc/k3d/%i.toml
Environment=K3D_ENDPOINT=ipc:///run/k3d/%i/k3d.sock
RuntimeDirectory=k3d/%i
RuntimeDirectoryMode=0750
# The policy's statistics (warm restart) live in $STATE_DIRECTORY, which k3d reads.
StateDirectory=k3d/%i
StateDirectoryMode=0750
{common}
[Install]
WantedBy=multi-user.target
"""

_SYSUSERS = """\
# k3d's fixed system user and group (systemd-sysusers); add model users to the
# group: usermod -aG k3d USER
u k3d - "k3d expert cache" /var/lib/k3d
"""

FILES = ("k3d.service", "k3d@.service", "k3d.sysusers.conf")
EXAMPLE_EXEC = "/usr/local/bin/k3d"     # what the copies in the repo's systemd/ use


def _mib(n: int) -> str:
    return f"{-(-n // 2**20)}M"     # systemd's M is MiB


def render(name: str, exec_path: str, arena: int) -> str:
    """The text of unit file ``name`` (one of ``FILES``)."""
    if name == "k3d.sysusers.conf":
        return _SYSUSERS
    common = _COMMON.format(arena=_mib(arena), memory_max=_mib(arena + HEADROOM))
    body = {"k3d.service": _SERVICE, "k3d@.service": _TEMPLATE}[name]
    return body.format(exec=exec_path, common=common)


def default_exec() -> str:
    """The ``k3d`` script of this installation, else ``python -P -m k3d`` (``-P``: a ``k3d``
    folder in the working directory is not imported in place of this installation)."""
    beside = os.path.join(os.path.dirname(sys.executable), "k3d")
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which("k3d")
    return found or f"{sys.executable} -P -m k3d"


DEFAULT_CONFIG = "/etc/k3d/k3d.toml"


def arena_from(config_file: str | None, given: str | None) -> int:
    """Arena bytes: ``--arena``, else the config file's ``arena``, else the default."""
    if given:
        return parse_size(given)
    if config_file and os.path.exists(config_file):
        data = load_file(config_file)
        if "arena" in data:
            return parse_size(data["arena"])
        if data.get("slots"):
            raise ConfigError(f"config file {config_file} sizes the arena by slots ({data['slots']}); MemoryMax "
                              "needs bytes: pass --arena (slots x the expert size, see `k3ctl status`)")
    return Config().arena


def closed_to_others(path: str) -> str | None:
    """The first directory above ``path`` that other users cannot enter (mode o-x), if any:
    the unit's ``k3d`` user could not run an ExecStart there (a pyenv under /root)."""
    d = os.path.dirname(os.path.abspath(path.split()[0]))
    while d and d != "/":
        try:
            if not os.stat(d).st_mode & 0o001:
                return d
        except FileNotFoundError:       # not made yet: what is above it decides
            pass
        d = os.path.dirname(d)
    return None


PRIVATE_TMP = ("/tmp", "/var/tmp")


def in_private_tmp(path: str) -> str | None:
    """The temporary directory ``path`` is under (itself, or where a link leads), if any: the
    unit's ``PrivateTmp=yes`` shows the service an empty one there, so an ExecStart (a venv
    made in /tmp) is not found."""
    first = path.split()[0]
    for p in (os.path.abspath(first), os.path.realpath(first)):
        for tmp in PRIVATE_TMP:
            if p.startswith(tmp + "/"):
                return tmp
    return None


def install(dest: str, sysusers_dir: str, exec_path: str, arena: int) -> list[str]:
    """Write the units to ``dest`` and the sysusers file to ``sysusers_dir``."""
    written = []
    for name in FILES:
        folder = sysusers_dir if name.endswith(".conf") else dest
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, "k3d.conf" if name.endswith(".conf") and folder != dest else name)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(render(name, exec_path, arena))
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
        written.append(path)
    return written


def add_parser(sub) -> None:
    p = sub.add_parser("install-unit", help="print or install the systemd units (k3d.service, k3d@.service)")
    p.add_argument("--print", dest="print_only", action="store_true", help="print the units, write nothing")
    p.add_argument("--dest", help="unit directory (default /etc/systemd/system)")
    p.add_argument("--sysusers-dir", help="where k3d.conf for systemd-sysusers goes "
                   "(default /etc/sysusers.d, or DEST when --dest is given)")
    p.add_argument("--arena", help="arena size the units are sized for (default: arena in --config, else 512MiB)")
    p.add_argument("--config", help="config file to read the arena size from (must exist; default "
                   "/etc/k3d/k3d.toml where it exists)")
    p.add_argument("--exec", dest="exec_path", help=f"what ExecStart runs (default: {default_exec()})")


def main(args: argparse.Namespace) -> int:
    if args.config is not None and not os.path.isfile(args.config):
        print(f"k3d: error: --config {args.config}: no such file (write it first, or leave --config out)",
              file=sys.stderr)
        return 1
    if args.config is None and os.path.isfile(DEFAULT_CONFIG):
        args.config = DEFAULT_CONFIG
    try:
        arena = arena_from(args.config, args.arena)
    except (ConfigError, ValueError) as e:
        print(f"k3d: error: {e}", file=sys.stderr)
        return 1
    exec_path = args.exec_path or default_exec()
    if importlib.util.find_spec("prometheus_client") is None:
        print("k3d: warning: the units serve Prometheus metrics on 127.0.0.1:9484, which needs prometheus_client "
              "where ExecStart runs: pip install 'k3d-expert-cache[metrics]' (or set K3D_METRICS= empty in the unit)",
              file=sys.stderr)
    closed = closed_to_others(exec_path)
    if closed:
        print(f"k3d: warning: ExecStart {exec_path.split()[0]} is under {closed}, which other users cannot enter: "
              "the k3d user could not start it; install k3d where it can (e.g. a venv under /opt) and pass --exec",
              file=sys.stderr)
    tmp = in_private_tmp(exec_path)
    if tmp:
        print(f"k3d: warning: ExecStart {exec_path.split()[0]} is under {tmp}, which the unit's PrivateTmp=yes "
              "replaces with an empty directory for the service: it could not start; install k3d elsewhere "
              "(e.g. a venv under /opt) and pass --exec", file=sys.stderr)
    if args.print_only:
        for name in FILES:
            print(f"# ---- {name}")
            print(render(name, exec_path, arena), end="")
        return 0
    dest = args.dest or "/etc/systemd/system"
    sysusers = args.sysusers_dir or (args.dest or "/etc/sysusers.d")
    try:
        written = install(dest, sysusers, exec_path, arena)
    except OSError as e:
        print(f"k3d: error: cannot write the units: {e}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    print("next: systemd-sysusers; write /etc/k3d/k3d.toml (source = \"/path/to/checkpoint\", arena = \"...\"); "
          "systemctl daemon-reload; systemctl enable --now k3d; usermod -aG k3d <model user>; "
          "model processes: K3D_ENDPOINT=ipc:///run/k3d/k3d.sock K3D_DAEMON_GROUP=k3d")
    return 0
