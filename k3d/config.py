"""Daemon configuration: one frozen dataclass, resolved in one function.

Precedence: command line > environment (``K3D_<FIELD>``) > TOML file
(``--config FILE`` or ``K3D_CONFIG``; top-level keys named as the fields) >
defaults.  ``resolve`` is the only place in the daemon that reads the
environment; it is handed ``os.environ`` by the CLI (tests pass a dict).

Every value is checked here: a bad one is a ``ConfigError`` with a single line
naming the key, where it came from and what is accepted.

Threads: ``resolve`` runs in the CLI's main thread at start and, for SIGHUP, in
the server thread (the daemon's main thread); a ``Config`` is frozen, so any
thread may read one.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import socket
import tomllib
from dataclasses import dataclass
from typing import Any

from k3client.endpoint import default_endpoint
from k3d.observe.metrics import parse_hostport
from k3d.sizes import parse_size

# The eviction policies a user may name (``k3d.cache.policy.POLICIES`` implements
# exactly these; config is read before, and without, the cache).
POLICY_NAMES = ("cycle", "lru")
# Who predicts: auto (the client's predictions, then the daemon's own predictor),
# client (only what clients name), off (nothing is read ahead).
PREDICT_MODES = ("auto", "client", "off")
DEFAULT_PATTERN = "model.layers.{layer}.mlp.experts.{expert}.{name}"


class ConfigError(Exception):
    pass


@dataclass
class Live:
    """The settings a running daemon changes on SIGHUP, in the one object every component
    reads them from at each use.  The server makes one from its config and
    ``serve/reload.apply`` updates it in place, so no setting is pushed into a
    component by hand.  Owned by the server thread.  Pure components (the store, the
    pacer) take one too; tests and ``k3d replay`` make their own."""
    pin_quota: int = 0        # slots one client may pin per token; 0 = no limit (read by the store only)
    max_share: float = 0.0    # pacing: a client's share of the loop's CPU (serve/pacing.py); 0 = off
    lease_s: float = 10.0     # the lease of clients that attach from now on
    trace: Any = None         # the open route trace (k3d.observe.trace.RouteTrace), or None

    @classmethod
    def of(cls, cfg: "Config", trace=None) -> "Live":
        live = cls()
        live.take(cfg, trace)
        return live

    def take(self, cfg: "Config", trace) -> None:
        """Take ``cfg``'s live settings and the open ``trace``: the one mapping from a config."""
        self.pin_quota, self.max_share, self.lease_s, self.trace = cfg.pin_quota, cfg.max_share, cfg.lease_s, trace


@dataclass(frozen=True)
class Config:
    source: str | None = None
    pattern: str | None = None        # None: the family rules (k3d.sources.families) find the experts
    arena: int = 512 * 2**20          # bytes; rounded down to whole slots
    slots: int = 0                    # if > 0, overrides arena
    endpoint: str = ""                # resolved: never empty after resolve()
    readers: int | None = None        # reader threads; None: chosen per read path (reads/plan.readers_for)
    trace: str | None = None
    lease_s: float = 10.0             # a client silent this long loses its pins
    pin_quota: int = 0                # slots one client may pin per token; 0 = no limit
    max_share: float = 2.0            # with more clients active, one may use this many times the average
                                      # client's share of the daemon's CPU, else it is paced (serve/pacing.py); 0 = off
    log_level: str = "info"
    read_mode: str = "buffered"       # packed sources: buffered | direct (O_DIRECT)
    http_conns: int = 4               # remote sources: persistent connections per host
    http_timeout: float = 30.0        # remote sources: seconds one whole request may take
    http_retries: int = 5             # remote sources: retries of a transient failure per request
    disk_cache: str | None = None     # remote sources: directory of the disk tier
    disk_cache_size: int = 16 * 2**30 # bytes the disk tier may hold (LRU beyond)
    hugepages: bool = False           # arena in hugetlb pages (vm.nr_hugepages must hold it)
    thp: bool = True                  # without hugepages: collapse the arena into transparent huge pages
    policy: str = "cycle"             # eviction policy, one of POLICY_NAMES
    predict: str = "auto"             # who predicts, one of PREDICT_MODES (k3d/cache/predict/)
    predict_budget: int = 0           # predictions per fetch, client's first; 0: as many as the fetch has keys
    state_dir: str = ""               # warm-restart statistics; resolved: $STATE_DIRECTORY (systemd),
                                      # else $XDG_STATE_HOME/k3d, else ~/.local/state/k3d; "none": off
    state_every_s: float = 60.0       # seconds between saves of the statistics (and one at shutdown)
    warm_slots: float = 1.0           # share of the arena pre-loaded from the saved hot set at start
    metrics: str | None = None        # HOST:PORT for Prometheus /metrics (:PORT: 127.0.0.1); off by default
    allow_remote_tcp: bool = False    # a tcp endpoint may listen beyond loopback (no credentials there)


def _size(value) -> int:
    v = parse_size(value)
    if v <= 0:
        raise ValueError("must be positive")
    return v


def _positive(value) -> float:
    if isinstance(value, bool):
        raise ValueError("not a number of seconds")
    v = float(value)
    if not 0 < v < 10**6:               # inf would overflow every timed wait
        raise ValueError("must be a positive number of seconds, under 1000000")
    return v


def _int_in(lo: int, hi: int | None = None):
    def conv(value) -> int:
        if isinstance(value, bool) or isinstance(value, float):
            raise ValueError("not an integer")
        v = int(value)
        if v < lo or (hi is not None and v > hi):
            raise ValueError(f"must be >= {lo}" if hi is None else f"out of range ({lo}..{hi})")
        return v
    return conv


def _readers(value):
    """1..64, or ``auto`` (None: the daemon picks per read path)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return None
    return _int_in(1, 64)(value)


def _one_of(*choices: str):
    def conv(value) -> str:
        v = str(value).lower()
        if v not in choices:
            raise ValueError(f"use {', '.join(choices[:-1])} or {choices[-1]}")
        return v
    return conv


def _bool(value) -> bool:
    if isinstance(value, bool):
        return value
    v = str(value).strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError("use true or false")


def _share(value) -> float:
    if isinstance(value, bool):
        raise TypeError("not a number")
    v = float(value)
    if not 0.0 <= v <= 1.0:
        raise ValueError("must be between 0 and 1")
    return v


def _max_share(value) -> float:
    """0 (pacing off) or a factor from 1 to 100: under 1 even a client at the average would be paced."""
    if isinstance(value, bool):
        raise TypeError("not a number")
    v = float(value)
    if not (v == 0 or 1 <= v <= 100):
        raise ValueError("must be 0 (off) or between 1 and 100")
    return v


def default_state_dir(env) -> str:
    """systemd's StateDirectory= ($STATE_DIRECTORY), else the XDG state directory."""
    if env.get("STATE_DIRECTORY"):
        return env["STATE_DIRECTORY"].split(":")[0]
    base = env.get("XDG_STATE_HOME") or os.path.join(env.get("HOME") or os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "k3d")


def _string(value) -> str:
    if not isinstance(value, str):
        raise ValueError("must be a string")
    return value


def _hostport(value) -> str:
    v = _string(value)
    parse_hostport(v)
    return v


def _endpoint(value) -> str:
    """``ipc://PATH`` (short enough for sun_path, with the ``.arena`` socket beside it) or ``tcp://HOST:PORT``."""
    v = _string(value)
    if v.startswith("ipc://"):
        path = v[len("ipc://"):]
        if not path.startswith("/"):
            raise ValueError("an ipc endpoint needs an absolute path (ipc:///run/k3d/k3d.sock)")
        if len(path + ".arena") > 107:
            raise ValueError(f"ipc path is {len(path)} characters; Unix sockets allow {107 - len('.arena')} here "
                             "(use a shorter directory)")
        return v
    m = re.fullmatch(r"tcp://(\[[0-9a-fA-F:.]+\]|[^:/\s]+):([0-9]+)", v)
    if m:
        if not 1 <= int(m.group(2)) <= 65535:
            raise ValueError(f"port {m.group(2)} is out of range (1..65535)")
        return v
    raise ValueError("use ipc:///path/k3d.sock or tcp://host:port")


def _loopback(host: str) -> bool:
    """Whether ``host`` (an address, a name) is this machine's loopback only: names count
    when every address they resolve to is loopback (``*`` and interface names are not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return False
    return all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def _check_remote(endpoint: str, allowed: bool) -> None:
    """A tcp endpoint beyond loopback only when the user accepted the risk."""
    m = re.fullmatch(r"tcp://\[?(.*?)\]?:[0-9]+", endpoint)
    if m is None or allowed or _loopback(m.group(1)):
        return
    raise ConfigError(
        f"endpoint {endpoint} listens beyond this machine ({m.group(1)} is not a loopback address): tcp peers "
        "carry no credentials, so anyone who reaches the port could attach, and a remote client gains nothing "
        "(the arena is shared memory on this machine); use tcp://127.0.0.1:PORT or an ipc endpoint, or pass "
        "--allow-remote-tcp (allow_remote_tcp = true) to accept the risk")


# Field -> converter; every other field is a string.
_CONVERTERS = {
    "arena": _size,
    "disk_cache_size": _size,
    "slots": _int_in(0),
    "pin_quota": _int_in(0),
    "max_share": _max_share,
    "readers": _readers,
    "http_conns": _int_in(1, 256),
    "http_retries": _int_in(0, 20),
    "lease_s": _positive,
    "http_timeout": _positive,
    "log_level": _one_of("debug", "info", "warning", "error"),
    "read_mode": _one_of("buffered", "direct"),
    "endpoint": _endpoint,
    "hugepages": _bool,
    "policy": _one_of(*POLICY_NAMES),
    "predict": _one_of(*PREDICT_MODES),
    "predict_budget": _int_in(0, 4096),
    "state_every_s": _positive,
    "warm_slots": _share,
    "thp": _bool,
    "metrics": _hostport,
    "allow_remote_tcp": _bool,
}


# Fields whose command-line option is not --<field with dashes>.
_OPTION = {"lease_s": "--lease"}


def _convert(name: str, value, origin: str):
    try:
        return _CONVERTERS.get(name, _string)(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{origin}: bad value {value!r} for {name}: {e}") from None


def load_file(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path} does not parse: {e}") from None
    except OSError as e:
        raise ConfigError(f"config file {path}: {e.strerror}") from None
    return data


def resolve(cli: dict, env, config_file: str | None = None) -> Config:
    """Merge CLI values (None = not given), ``K3D_*`` env and the TOML file."""
    names = [f.name for f in dataclasses.fields(Config)]
    values: dict = {}
    path = config_file or env.get("K3D_CONFIG")
    if path:
        data = load_file(path)
        for key in data:
            if key not in names:
                raise ConfigError(f"config file {path}: unknown key {key!r} (known: {', '.join(names)})")
        for key, v in data.items():
            values[key] = _convert(key, v, f"config file {path}")
    for name in names:
        ev = env.get(f"K3D_{name.upper()}")
        if ev is not None and ev != "":
            values[name] = _convert(name, ev, f"environment K3D_{name.upper()}")
    for name, v in cli.items():
        if v is not None:
            if name not in names:
                raise ConfigError(f"unknown option {name}")
            values[name] = _convert(name, v, _OPTION.get(name, f"--{name.replace('_', '-')}"))
    # --arena on the command line sizes the arena even where the file or environment
    # gave slots (slots would otherwise override it: the user's last word wins)
    if cli.get("arena") is not None and cli.get("slots") is None:
        values.pop("slots", None)
    # CLI, env and file are merged above; the default is the rule clients share.
    values["endpoint"] = values.get("endpoint") or _convert("endpoint", default_endpoint(env), "default endpoint")
    _check_remote(values["endpoint"], values.get("allow_remote_tcp", False))
    if values.get("disk_cache"):
        values["disk_cache"] = os.path.abspath(values["disk_cache"])
    if values.get("trace"):
        values["trace"] = os.path.abspath(values["trace"])
    state = values.get("state_dir") or default_state_dir(env)
    values["state_dir"] = "" if state.lower() == "none" else os.path.abspath(state)
    return Config(**values)
