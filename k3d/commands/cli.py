"""``k3d``: start the daemon, pack a checkpoint, install the systemd units, or run the demo.

Runs in the process's main thread.  ``k3d.service.units`` (which adds its own
``install-unit`` parser) is imported up front; the other subcommands' modules only
when they run (``k3d.commands.pack``, ``k3d.demo``, ``start``'s ``k3d.service.daemon``), so
``k3d --help`` stays light.  Every default in ``start``'s help is read from
``Config`` (``D``), where it is written once.  ``start`` resolves the
config here (``k3d.config.resolve``, the one reader of the environment) and hands
it to ``k3d.service.daemon.run``, which serves in this same thread.

``k3d start`` runs in the foreground (no double fork: systemd's Type=notify
way), logs to stderr, prints a ``ready`` line once it serves, and exits 0 after
SIGTERM/SIGINT.  Every start-up failure is one line on stderr and exit 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from k3d import __version__
from k3d.cache.policy import POLICIES
from k3d.commands import inspect as inspection
from k3d.commands.ctl import parse_args
from k3d.config import Config, ConfigError, resolve
from k3d.reads.plan import COLD_READERS
from k3d.service import units
from k3d.sizes import show_size

D = Config()     # the defaults, written once (config.py); help strings read them here


def _start_parser(sub):
    p = sub.add_parser("start", help="run the daemon in the foreground")
    p.add_argument("--config", help="TOML config file (keys as the long options, e.g. arena = \"8GiB\")")
    p.add_argument("--source", help="checkpoint: safetensors directory/file, .gguf or .k3pack file, "
                   "or an http(s):// or s3:// URL of one")
    p.add_argument("--pattern", help="tensor name pattern with {layer}, {expert}, {name} (default: the model "
                   "family, from config.json or the tensor names)")
    p.add_argument("--arena", help="arena size: 512MiB, 8GiB or bytes, rounded down to whole slots "
                   f"(default {show_size(D.arena)})")
    p.add_argument("--slots", type=int, help="arena size as a number of slots (overrides --arena)")
    p.add_argument("--endpoint", help="ZeroMQ endpoint (default ipc://$XDG_RUNTIME_DIR/k3d/k3d.sock); "
                   "tcp://HOST:PORT on loopback only, unless --allow-remote-tcp")
    p.add_argument("--allow-remote-tcp", dest="allow_remote_tcp", action="store_const", const=True, default=None,
                   help="let a tcp endpoint listen beyond loopback: its peers carry no credentials, so anyone who "
                   "reaches the port may attach (clients must run on this machine anyway: the arena is local)")
    p.add_argument("--readers", help="reader threads, or auto (default: 2 per CPU, "
                   f"2-{COLD_READERS}, for safetensors/GGUF page-cache reads; {COLD_READERS} for packed "
                   "files and HTTP/S3 origins)")
    p.add_argument("--trace", help="append a route trace line per fetch to FILE")
    p.add_argument("--lease", dest="lease_s", type=float,
                   help=f"seconds a silent client keeps its pins (default {D.lease_s:g})")
    p.add_argument("--pin-quota", dest="pin_quota", type=int,
                   help=f"slots one client may pin per token (0: no limit; default {D.pin_quota})")
    p.add_argument("--max-share", dest="max_share", type=float,
                   help="while more clients than this are active, one may use this many times the average "
                   "client's share of the daemon's CPU; a client over it waits before its next request is served "
                   f"(0: off; default {D.max_share:g})")
    p.add_argument("--log-level", dest="log_level", help=f"debug, info, warning, error (default {D.log_level})")
    p.add_argument("--read-mode", dest="read_mode",
                   help="packed files: buffered (page cache, dropped after reading) or direct (O_DIRECT); "
                   f"default {D.read_mode}")
    p.add_argument("--http-conns", dest="http_conns", type=int,
                   help=f"remote sources: persistent connections per host (default {D.http_conns})")
    p.add_argument("--http-timeout", dest="http_timeout", type=float,
                   help="remote sources: seconds one request may take in all, connect, headers and body "
                   f"(a body still arriving then is given up on and retried; default {D.http_timeout:g})")
    p.add_argument("--http-retries", dest="http_retries", type=int,
                   help=f"remote sources: retries of a failing request, full-jitter backoff (default {D.http_retries})")
    p.add_argument("--disk-cache", dest="disk_cache",
                   help="remote sources: keep fetched experts in DIR (crash-safe, survives restarts)")
    p.add_argument("--disk-cache-size", dest="disk_cache_size",
                   help="bytes the disk cache may hold, e.g. 100GiB "
                   f"(LRU beyond; default {show_size(D.disk_cache_size)})")
    p.add_argument("--hugepages", action="store_const", const=True, default=None,
                   help="put the arena in hugetlb pages (reserve them first: sysctl vm.nr_hugepages)")
    p.add_argument("--no-thp", dest="thp", action="store_const", const=False, default=None,
                   help="skip the huge-page collapse: less CPU after start, but O_DIRECT and disk reads into "
                   "the arena slower (default: collapse the arena into 2 MiB transparent huge pages, what is cheap "
                   "at start, the rest after ready; bench/startup.py measures both)")
    p.add_argument("--policy", help=f"eviction policy: {', '.join(sorted(POLICIES))} (default {D.policy})")
    p.add_argument("--predict", help="who reads ahead: auto (clients' predictions, then the daemon's own, learned "
                   "from the access stream), client (only clients' predictions) or off "
                   f"(default {D.predict})")
    p.add_argument("--predict-budget", dest="predict_budget", type=int,
                   help="predictions per fetch, the client's own first (0: as many as the fetch has keys; "
                   f"default {D.predict_budget})")
    p.add_argument("--state-dir", dest="state_dir",
                   help="where the policy's statistics survive restarts (default $XDG_STATE_HOME/k3d; none: off)")
    p.add_argument("--metrics", metavar="HOST:PORT",
                   help="serve Prometheus /metrics there, e.g. 127.0.0.1:9484 (:PORT: 127.0.0.1) "
                   "(needs pip install 'k3d-expert-cache[metrics]')")
    return p


def _pack_parser(sub):
    p = sub.add_parser("pack", help="convert a safetensors directory or GGUF file to the packed format")
    p.add_argument("src", help="safetensors directory/file or .gguf file")
    p.add_argument("out", help="output file (conventionally NAME.k3pack); written atomically")
    p.add_argument("--pattern", help="safetensors tensor name pattern with {layer}, {expert}, {name} "
                   "(default: the model family)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return p


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="k3d", description="shared expert-weight cache daemon")
    ap.add_argument("--version", action="version", version=f"k3d {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    _start_parser(sub)
    _pack_parser(sub)
    from k3d.commands import replay as replay_cli  # the CLI dispatching a subcommand's module
    replay_cli.add_parser(sub)
    units.add_parser(sub)
    inspection.add_parser(sub)
    d = sub.add_parser("demo", help="run the embedded demo: synthetic checkpoint, daemon, 3 model processes")
    d.add_argument("--tokens", type=int, default=200, help="tokens each model process runs (default %(default)s)")
    d.add_argument("--clients", type=int, default=3, help="model processes sharing the daemon (default %(default)s)")
    d.add_argument("--seed", type=int, default=1234,
                   help="seed of the synthetic checkpoint and of the routing (default %(default)s)")
    d.add_argument("--hf", action="store_true",
                   help="transformers processes (k3client.hf) generating with one daemon, vs plain ones")
    args = parse_args(ap, sub, argv)
    if args.cmd == "demo":
        for opt, value, top in (("--tokens", args.tokens, 100000), ("--clients", args.clients, 64)):
            if not 1 <= value <= top:
                print(f"k3d demo: error: {opt} {value}: use 1 to {top}", file=sys.stderr)
                return 2
        from k3d.demo.children import interrupted
        try:
            if args.hf:
                from k3d.demo.hf import run_hf_demo
                return run_hf_demo(clients=args.clients, tokens=min(args.tokens, 32))
            from k3d.demo.run import run_demo
            return run_demo(tokens=args.tokens, clients=args.clients, seed=args.seed)
        except KeyboardInterrupt as e:       # Ctrl-C: the children are stopped by now
            return interrupted("k3d demo", e)
    if args.cmd == "replay":
        return replay_cli.main(args)
    if args.cmd == "install-unit":
        return units.main(args)
    if args.cmd == "inspect":
        return inspection.main(args)
    if args.cmd == "pack":
        from k3d.commands.pack import pack_main
        return pack_main(args.src, args.out, args.pattern, args.force, args.progress)
    cli = {k: v for k, v in vars(args).items() if k not in ("cmd", "config")}
    try:
        cfg = resolve(cli, os.environ, args.config)
    except ConfigError as e:
        print(f"k3d: error: {e}", file=sys.stderr)
        return 1
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format="k3d: %(levelname)s %(message)s")
    from k3d.service.daemon import StartupError, run
    try:
        return run(cfg, os.environ, reload=lambda: resolve(cli, os.environ, args.config))
    except StartupError as e:
        print(f"k3d: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
