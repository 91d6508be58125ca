"""Where the daemon listens: one rule shared by the daemon, k3ctl and clients.

Precedence: explicit argument > ``K3D_ENDPOINT`` > (daemon only: config file) >
``ipc://$XDG_RUNTIME_DIR/k3d/k3d.sock`` or ``ipc:///tmp/k3d-$UID/k3d.sock``.
The environment is passed in (``env``) so callers decide what they read.
Pure functions (they read only the file system): safe from any thread.
"""

from __future__ import annotations

import os


def default_endpoint(env) -> str:
    runtime = env.get("XDG_RUNTIME_DIR")
    if runtime:
        return f"ipc://{runtime}/k3d/k3d.sock"
    return f"ipc:///tmp/k3d-{os.getuid()}/k3d.sock"


def resolve_endpoint(explicit: str | None, env) -> str:
    return explicit or env.get("K3D_ENDPOINT") or default_endpoint(env)


def ipc_path(endpoint: str) -> str | None:
    """Filesystem path of an ``ipc://`` endpoint, else None."""
    return endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else None


def arena_socket_for(endpoint: str, env) -> str:
    """Path of the Unix socket that hands out the arena fd, beside the ipc socket."""
    path = ipc_path(endpoint)
    if path:
        return path + ".arena"
    port = endpoint.rsplit(":", 1)[-1]
    base = ipc_path(default_endpoint(env))
    return os.path.join(os.path.dirname(base), f"k3d-{port}.arena")


def unreachable_dir(path: str) -> str | None:
    """The nearest directory above ``path`` that exists but this process may not enter
    (the sockets' 0750 directory, for a user outside the daemon's group); None if
    nothing in the way is closed to it."""
    d = os.path.dirname(path)
    while d and d != "/":
        if os.path.isdir(d):
            return None if os.access(d, os.X_OK) else d
        d = os.path.dirname(d)
    return None


def no_access_message(path: str, blocked: str) -> str:
    return (f"cannot reach the k3d socket {path}: no permission to enter {blocked} (the daemon's user "
            "and group only: join its group, e.g. `usermod -aG k3d $USER`, and log in again)")
