"""A client's attachment to the daemon: the connection, the session, the arena, re-attaching.

What it holds, all of the one daemon generation ``gen`` attached now: the
connection ``chan`` (``channel.py``: the request socket and its peer), the
session (``client_id``, and ``lease``, the pair the lease thread renews), what
``hello`` told (``layout``, ``layouts`` and their specs by name, ``model``,
``slots``, ``slot_bytes``, ``expert_bytes``, ``lease_s``, ``pin_quota``), the
arena's read-only mapping ``mm`` with the views cached on it (``views``, keyed as
``views.py`` says), and the shared index ``hits`` (``hits.py``) while this client
answers hits itself.  Across attachments: ``endpoint``, ``name``, ``trust``, the
hit path (``hit_path``; ``hit_path_why`` when it fell back to the daemon),
``reconnect_timeout``, ``restarts`` and the ``before_unmap`` hooks.  ``Client``
holds one attachment for its whole life and reads these through it.

Daemon restarts: every reply carries the daemon's generation ``gen``.  The
connection notices a restart when a reply's ``gen`` changes, when the daemon
process exits while a request waits, when the ipc socket file is replaced, or
when the daemon answers ``ShuttingDown``.  The client then re-attaches
(``reattach``: a new channel, ``hello``, the new arena's memfd) and re-issues the
request it was making, within ``reconnect_timeout`` seconds, else
``DaemonNotRunning``.  Invariant: an ``Expert`` is bound to the generation that
named its slot; after a re-attach it raises ``DaemonRestarted`` instead of
building a view, so nothing ever reads a slot number of the old arena in the new
one (``gen`` keeps the old generation while a re-attach is under way, and is None
once it failed: every old ``Expert`` refuses).  Views made before the restart keep
the old mapping (the kernel keeps that memfd alive while it is mapped), so their
bytes stay correct.  A restarted daemon that serves another layout is not
re-attached to (``_LayoutChanged``): the caller must connect again.  Nor, once
``Client.verify`` has passed (``verified``: the content digest it compared; the
hf and vLLM loaders verify), is one that serves another checkpoint of the same
layout (a fine-tune): the new daemon's digest must be the verified one, waited
for within ``reconnect_timeout`` while it is pending (``_same_checkpoint``).  A
client that never verified follows the daemon to whatever it serves now, by the
layout alone, as it always did.

Trust: each (re-)attach verifies what answers before any view is built (peer
uid, socket directories, memfd seals: ``trust.py``), else ``Untrusted``.

Messages: every request leaves through ``post``, under ``io``, with what every
message carries: the hit reports (``LocalHits.take``) or, without the hit path,
the layers released since the last message (``done``).  The lease thread sends
the reports and the index count it has seen while the client computes
(``lease_sync``: ``LocalHits.sync``).  Reports are taken and sent in one step
under ``io``, so they reach the daemon in the order they were answered; a
message that does not leave puts its reports back first (``LocalHits.failed``).
Hit reports are this daemon's: a detach drops them with the index.

Threads: the client's thread attaches, re-attaches and detaches.  The lease
thread reads ``lease`` (one tuple, assigned at once: it must never pair one
attachment's id with another's generation, or it would renew a stranger) and
``lease_s``, and uses ``chan`` and ``hits`` only under ``io``, the lock of the
request socket, under which ``detach`` closes them.  ``wake`` is the lease
thread's: set at every attach, so that it beats at once, at the new daemon's
lease.  Caller's obligations: re-attach and detach from the client's thread only,
having dropped any reply still awaited on the old channel; ``before_unmap``
hooks (callables of the mapping, run before it is unmapped: a GPU runtime
unregisters it there, ``k3client/gpu/pinning.py``) must not raise.
"""

from __future__ import annotations

import os
import time

import zmq

from . import errors, handout
from .channel import Channel
from .endpoint import ipc_path, no_access_message, unreachable_dir
from .hits import LocalHits
from .layout import TensorSpec, layouts_from_wire

DIGEST_POLL_S = 0.05      # a restarted daemon's pending digest is asked for again this often


class _LayoutChanged(errors.DaemonRestarted):
    """The restarted daemon serves another layout: re-attaching would mislead the caller."""


class Attached:
    """A ``Client`` attribute that is its attachment's: read and set on ``Client._at``."""

    __slots__ = ("name",)

    def __init__(self, name: str | None = None):
        self.name = name

    def __set_name__(self, owner, name: str) -> None:
        if self.name is None:
            self.name = name

    def __get__(self, client, owner=None):
        return self if client is None else getattr(client._at, self.name)

    def __set__(self, client, value) -> None:
        setattr(client._at, self.name, value)


class Attachment:
    """What one client holds of the daemon it is attached to (module docstring)."""

    def __init__(self, ctx, endpoint: str, name: str, trust, hit_path: tuple[str, str | None],
                 reconnect_timeout: float, wake, io):
        self.endpoint, self.name, self.trust = endpoint, name, trust
        self.hit_path, self.hit_path_why = hit_path
        self.reconnect_timeout = reconnect_timeout   # 0: raise DaemonRestarted at once
        self.verified = None                         # the digest Client.verify passed with (verify.py)
        self.restarts = 0                            # re-attachments so far
        self.gen = None
        self.layout = None
        self.layouts: dict[int, list[TensorSpec]] = {}   # every layer's layout when layers differ, else {}
        self.layers: frozenset | None = None         # the layers served (hello's model), None: not known
        self.mm = None
        self.hits: LocalHits | None = None   # the shared index, while attached with the hit path
        self.views: dict = {}                # (slot, layer or -1, tensor) -> view (views.py)
        self.before_unmap: list = []         # callables(mmap) run before the mapping is unmapped
        self.chan: Channel | None = None     # the connection to the daemon attached now
        self.done: dict[int, None] = {}      # released layers for the next message, without the hit path
        self.io = io                         # the request socket's lock (module docstring)
        self._ctx, self._wake = ctx, wake

    def check_layer(self, layer: int, op: str) -> None:
        """``UnknownExpert`` in one line if the daemon serves no ``layer`` (hello's model)."""
        if self.layers is not None and layer not in self.layers:
            raise errors.UnknownExpert(f"{op}({layer}): the daemon at {self.endpoint} serves no layer {layer} (it "
                                       f"has layers {min(self.layers)}-{max(self.layers)}); release a layer "
                                       "this client fetched")

    def layout_of(self, layer: int) -> list[TensorSpec]:
        return self.layouts.get(layer, self.layout)

    def specs_of(self, layer: int) -> dict[str, TensorSpec]:
        return self._layer_specs.get(layer, self._specs)

    # -- messages on the request socket: what each carries -------------------------
    def post(self, hits, op: str, fields: dict) -> int:
        """Under ``io``: send ``op`` with ``fields`` plus what every message carries
        (``_outgoing``); returns its request id.  The local-hit window shuts first (C1).  If
        the message does not leave, the reports taken for it go first in the next one
        (``LocalHits.failed``, still under ``io``: the lease thread must not send a count
        before they go again).  A ``begin_token`` that left starts the new token's counts."""
        try:
            if hits is not None:
                hits.open = False
            fields.update(self._outgoing(hits))
            rid = self.chan.post(op, **fields)
        except BaseException:
            if hits is not None:
                hits.failed()
            raise
        if hits is not None:
            hits.sent()
            if op == "begin_token":
                hits.new_token()
        if op == "begin_token":
            self.done = {}
        return rid

    def _outgoing(self, hits) -> dict:
        """Under ``io``: what the next message carries besides its op's fields: the hit
        reports (``LocalHits.take``) and the layers released since the last message (``done``)."""
        if hits is not None:
            return hits.take()
        done, self.done = self.done, {}
        return {"done": list(done)} if done else {}

    def release(self, layer: int) -> None:
        """The client is done with ``layer`` this token: the next message says so (with the hit
        path in its reports, ``LocalHits.release``; else as ``done``)."""
        if self.hits is not None:
            self.hits.release(layer)
        else:
            self.done[layer] = None

    def send_reports(self, hits) -> None:
        """The hit reports taken so far, in a ``hits`` message now (many were answered
        without one); put back first in the next message if it does not leave."""
        with self.io:
            fields = hits.take()
            if fields:
                try:
                    self.chan.send("hits", **fields)
                    hits.sent()
                except BaseException:
                    hits.unsend()
                    raise

    def lease_sync(self) -> None:
        """On the lease thread: send the hit reports and the index count seen (``LocalHits.sync``)
        unless the client's thread is using the request socket (its message carries them)."""
        hits, chan = self.hits, self.chan
        if hits is None or chan is None or not self.io.acquire(blocking=False):
            return
        try:
            if self.hits is hits and self.chan is chan:
                fields = hits.sync()
                if fields:
                    chan.send("hits", **fields)
                    hits.sent()
        except zmq.ZMQError:
            hits.unsend()                     # a closing socket: the client's thread carries on
        finally:
            self.io.release()

    def bye(self) -> None:
        """Say bye with the last reports (the daemon releases this client's pins); a daemon
        that does not answer within a second is left to the lease."""
        if self.chan is not None:
            try:
                with self.io:
                    self.chan.request("bye", 1.0, **(self.hits.take() if self.hits is not None else {}))
            except errors.K3Error:
                pass

    # -- attaching ------------------------------------------------------------------
    def connect_waiting(self, connect_timeout: float, wait: float) -> None:
        """``connect``; with ``wait`` > 0, retried while the daemon is starting or not there yet."""
        deadline = time.monotonic() + wait
        while True:
            try:
                self.connect(connect_timeout)
                return
            except (errors.Starting, errors.DaemonNotRunning) as e:
                self.detach()
                if time.monotonic() >= deadline:
                    if wait and isinstance(e, errors.Starting):
                        raise errors.Starting(f"{e} (waited {wait:g}s)") from None
                    raise
                time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    def connect(self, connect_timeout: float):
        """One attempt: a new channel, hello, the arena's memfd."""
        path = ipc_path(self.endpoint)
        if path is not None and not os.path.exists(path):
            blocked = unreachable_dir(path)
            if blocked:
                raise errors.PermissionDenied(no_access_message(path, blocked))
            raise errors.DaemonNotRunning(
                f"k3d daemon not running at {self.endpoint}: no socket {path} (start it with `k3d start`)")
        self.chan = Channel(self._ctx, self.endpoint)
        self.gen = None
        try:
            self._asked_hit_path = self.hit_path == "client"
            h = self.chan.request("hello", connect_timeout, name=self.name, pid=os.getpid(),
                                  hit_path=self._asked_hit_path)
        except errors.Timeout:
            raise errors.DaemonNotRunning(
                f"k3d daemon not running at {self.endpoint}: no answer in {connect_timeout:g}s") from None
        arena_socket = self.trust.hello_peer(self.chan.peer, self.endpoint, h["arena_socket"])
        layout = [TensorSpec.from_wire(w) for w in h["layout"]]
        layouts = layouts_from_wire(h["model"].get("layouts"))
        if self.layout is not None and (layout != self.layout or h["expert_bytes"] != self.expert_bytes
                                        or layouts != self.layouts):
            raise _LayoutChanged(
                f"the daemon at {self.endpoint} came back serving a different expert layout "
                f"({h['model'].get('path')}); connect again")
        if self.layout is not None:
            self._same_checkpoint(h["model"], connect_timeout)
        self.gen = h["gen"]
        self.client_id = h["client_id"]
        self.lease = (self.client_id, self.gen)     # one tuple, assigned at once (module docstring)
        self.layout = layout
        self._specs = {s.name: s for s in self.layout}
        self.layouts = layouts
        self._layer_specs = {l: {s.name: s for s in lay} for l, lay in layouts.items()}
        self.model = h["model"]
        # the layers served (a release_layer of another is refused at the call)
        self.layers = frozenset(l for l in self.model.get("layers", ()) if type(l) is int) or None
        self.slots = h["slots"]
        self.slot_bytes = h["slot_bytes"]
        self.expert_bytes = h["expert_bytes"]
        self.lease_s = h["lease_s"]
        self.pin_quota = h.get("pin_quota", 0)
        self._wake.set()         # a (re)attach: beat now, at this daemon's lease from here on
        self._attach_arena(arena_socket, h["arena_bytes"], h["index_bytes"])
        if self._asked_hit_path and self.hits is None:
            # The index could not be mapped: the daemon counts this client as one that
            # reads it, and would wait for its index counts.  Say hello again without.
            h = self.chan.request("hello", connect_timeout, name=self.name, pid=os.getpid(), hit_path=False)
            self.client_id = h["client_id"]
            self.lease = (self.client_id, self.gen)

    def _same_checkpoint(self, model: dict, timeout: float) -> None:
        """On a re-attach: ``_LayoutChanged`` unless the daemon serves the digest this client
        verified (module docstring); its digest asked for again while it is pending."""
        if self.verified is None:
            return
        # (imported here, as Client.verify imports verify: loaded once a client verifies)
        from .verify import computed
        now = computed(model.get("digest") or {},
                       lambda: self.chan.request("status", timeout)["status"]["model"].get("digest") or {},
                       time.monotonic() + max(self.reconnect_timeout, timeout), DIGEST_POLL_S)
        if now.get("hex") != self.verified:
            what = (f"content digest {now['hex'][:12]}" if now.get("hex") else
                    "its content digest still pending" if now.get("pending") else
                    f"no content digest ({now.get('error', 'none')})")
            raise _LayoutChanged(
                f"the daemon at {self.endpoint} came back serving another checkpoint ({model.get('path')}: "
                f"{what}, not the verified {self.verified[:12]}); connect again")

    def detach(self) -> None:
        """Close the channel, the index and the mapping (views alive keep the old mapping)."""
        with self.io:
            if self.chan is not None:
                self.chan.close()
                self.chan = None
            self.views.clear()
            if self.hits is not None:        # its reports were for the daemon that went away
                self.hits.close()
                self.hits = None
        if self.mm is not None:
            try:
                for hook in self.before_unmap:
                    hook(self.mm)
            finally:
                try:
                    self.mm.close()
                except BufferError:
                    pass  # views still alive; the old mapping goes when they do
                self.mm = None

    def reattach(self, why: str) -> None:
        """Attach to the restarted daemon within ``reconnect_timeout`` or raise."""
        old = self.gen
        self.detach()
        self.gen = old      # until the new hello: old Experts keep refusing after a failure
        if not self.reconnect_timeout:
            raise errors.DaemonRestarted(f"the daemon at {self.endpoint} went away ({why}); reconnect")
        deadline = time.monotonic() + self.reconnect_timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.gen = None   # no arena: every Expert refuses
                raise errors.DaemonNotRunning(
                    f"k3d daemon at {self.endpoint} did not come back within {self.reconnect_timeout:g}s "
                    f"({why}); check `systemctl status k3d` / `k3ctl status`")
            try:
                self.connect(min(left, 2.0))
                break
            except (_LayoutChanged, errors.Untrusted):   # no arena, no channel: nothing to read
                self.detach()
                self.gen = None
                raise
            except (errors.DaemonNotRunning, errors.DaemonRestarted, errors.ShuttingDown, errors.Timeout,
                    errors.Starting):
                self.detach()
                self.gen = old
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        self.restarts += 1

    def _attach_arena(self, path: str, size: int, index_size: int):
        self.mm, index_fd = handout.receive(path, size, self.gen, self.trust, (self.chan.peer or (0, 0, None))[2])
        if index_fd is None:
            return
        try:
            if self.hit_path == "client" and self.hits is None:
                self.hits = LocalHits(index_fd, index_size, self.chan.pidfd, self.pin_quota)
        except (OSError, ValueError) as e:
            self.hit_path, self.hit_path_why = "daemon", f"cannot map the shared index: {e}"
        finally:
            os.close(index_fd)
