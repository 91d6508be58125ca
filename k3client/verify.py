"""``Client.verify``: is the daemon serving the checkpoint at ``path``, by its bytes?

Compares the daemon's content digest (``hello``'s ``model.digest``, computed from
its source at start-up: ``k3d.sources.digest``) with the same rule run on the
local checkpoint (``k3client.local_experts``): layers, tensor names, dtypes, shapes,
expert counts and sampled bytes of every expert tensor (``k3client.digest``).  A
fine-tune of the served model (same config, other values) differs in its bytes.

Raises ``Mismatch`` in one line naming the local path, the daemon's endpoint,
model path and digest prefix, and the first layer and tensor that differ.  A
daemon without a digest, or a local format this client cannot read, is a
``Mismatch`` too ("cannot verify ..."): verify never passes what it did not
compare.  A daemon still computing its digest after ready (``pending``) is asked
again (``status``) until it has it, for up to the client's ``timeout``.  A
verify that passed binds the client to that digest: it re-attaches only to a
restarted daemon that serves it (``k3client/attachment.py``).  Reads
at most 32 KiB per expert tensor of the local files; no state.
"""

from __future__ import annotations

import os
import time

from .digest import first_difference
from .errors import Mismatch
from .local_experts import Unsupported, digest


def verify(client, path: str) -> dict:
    """Raise Mismatch unless ``path`` holds the experts the daemon serves; returns the digest."""
    model = client.model or {}
    served = model.get("digest")
    where = f"the k3d daemon at {client.endpoint} serves {model.get('path', '?')}"
    fix = f"start one with `k3d start --source {path}` and pass its endpoint"
    served = _when_computed(client, served, where, path)
    if not isinstance(served, dict) or "hex" not in served:
        why = served.get("error") if isinstance(served, dict) else "it reports no content digest (an older k3d?)"
        raise Mismatch(f"cannot verify {path} against {where}: {why}")
    if not os.path.exists(path):
        raise Mismatch(f"cannot verify {path} against {where}: no such file or directory")
    try:
        local = digest(path, model, client.layout_of)
    except Unsupported as e:
        raise Mismatch(f"cannot verify against {where}: {e}") from None
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise Mismatch(f"cannot verify {path} against {where}: cannot read it ({e})") from None
    diff = first_difference(served, local)
    if diff is not None:
        raise Mismatch(f"{where} (digest {served['hex'][:12]}), not {path} (digest {local['hex'][:12]}): "
                       f"{diff}; {fix}")
    client._at.verified = local["hex"]       # a restarted daemon must serve it too (attachment.py)
    return local


def computed(digest, ask, deadline: float, step: float):
    """``digest`` (a daemon's ``model.digest``) once it is no longer ``pending``
    (k3d.sources.digest.AfterReady), asking ``ask()`` for it again every ``step`` seconds
    until ``deadline`` (``time.monotonic``); at the deadline, the last answer, pending or not.
    ``verify`` and a verified client's re-attach (``attachment.py``) both wait this way."""
    while isinstance(digest, dict) and digest.get("pending") and time.monotonic() < deadline:
        time.sleep(step)
        digest = ask()
    return digest


def _when_computed(client, served, where: str, path: str):
    """The daemon's digest once computed, within the client's ``timeout``; else ``Mismatch``."""
    served = computed(served, lambda: client.status()["model"].get("digest"),
                      time.monotonic() + client.timeout, 0.1)
    if isinstance(served, dict) and served.get("pending"):
        raise Mismatch(f"cannot verify {path} against {where}: it is still computing its content digest "
                       f"({served.get('done', 0)} of {served.get('total', '?')} experts after "
                       f"{client.timeout:g}s); try again later")
    return served
