"""The model-process side: connect, fetch experts, read them zero-copy.

Thread-safety: a ``Client`` is used from one thread (its DEALER socket is not
thread-safe).  A second, private thread sends lease heartbeats on its own
socket so a live but busy process keeps its pins; a hung or stopped process
stops heartbeating and the daemon releases its pins after ``lease_s``.

Hits without a message (``hit_path="client"``, the default on x86-64): a fetch
whose experts are all READY in the daemon's shared index is answered here and
reported with the next message (``hits.py``); only a fetch with a key not ready
goes to the daemon, with all its keys (as does one with predictions of experts
not resident).  Predictions of resident keys send nothing.  Where the CPU lacks the ordering the index
needs, or with ``K3D_HIT_PATH=daemon``, every fetch is a round trip.

``fetch_iter`` hands experts out as they become ready: the resident ones from
the first part of the daemon's answer, the others as their reads finish
(``stream.py``, which states how the hit path's window stays shut until the
final part); one such iteration at a time, used up before the client's next call.

The guarantee: a view returned by ``Expert.array``/``Expert.tensor``/``stacked``,
however it was answered, keeps its bytes until this client's next
``begin_token()`` or ``close()``, with no time bound while the process lives and
whatever happened in between (a request that timed out or was interrupted, an
error reply, a restart of the daemon).  The daemon keeps the slot pinned, or, for
a hit the client answered itself, does not reuse it while the client may read it
(``k3d/cache/reuse.py``, which states the client's obligations; ``hits.py`` and
this module meet them).  A process that exits, or stops heartbeating for
``lease_s``, loses its pins.  Views are read-only; the mapping is PROT_READ and
the memfd is sealed, so a write through a numpy view raises ``ValueError`` and a
write through a torch view faults the process.

The request socket is used under ``_io`` by this client's thread and by its
lease thread (which sends the hit reports and the index count it has seen while
the client computes: ``LocalHits.sync``); reports are taken and sent in one
step under it, so they reach the daemon in the order they were answered.

Daemon restarts: every reply carries the daemon's generation ``gen``.  The
client's connection (``channel.py``) notices a restart when a reply's ``gen``
changes, when the daemon process exits while a request waits, when the ipc
socket file is replaced, or when the daemon answers ``ShuttingDown``.  The
client then re-attaches (a new channel, ``hello``, the new arena's memfd) and re-issues the
request it was making, within ``reconnect_timeout`` seconds, else raises
``DaemonNotRunning``.  Invariant: an ``Expert`` is bound to the generation
that named its slot; after a re-attach it raises ``DaemonRestarted`` instead
of building a view, so nothing ever reads a slot number of the old arena in
the new one.  Views made before the restart keep the old mapping (the kernel
keeps that memfd alive while it is mapped), so their bytes stay correct.

Trust: each (re-)attach verifies what answers before any view is built (peer
uid, socket directories, memfd seals: ``trust.py``), else ``Untrusted``.
"""

from __future__ import annotations

import os
import threading
import time
import weakref

import zmq

from . import errors, handout
from .channel import Channel, Gone
from .endpoint import ipc_path, no_access_message, resolve_endpoint, unreachable_dir
from .hits import REPORT_FLUSH, LocalHits, hit_path_mode
from .layout import TensorSpec, layouts_from_wire
from .lease import end_heartbeat, heartbeat
from .protocol import items, key_int, key_pairs
from .stream import stream
from .trust import Trust
from .views import Expert

_INTS = frozenset((int,))


class _LayoutChanged(errors.DaemonRestarted):
    """The restarted daemon serves another layout: re-attaching would mislead the caller."""


class Client:
    """A connection to the k3d daemon.  Use ``k3client.connect``."""

    def __init__(self, endpoint: str | None = None, name: str | None = None,
                 timeout: float = 120.0, connect_timeout: float = 5.0,
                 reconnect_timeout: float = 30.0, wait: float = 0.0, hit_path: str | None = None,
                 daemon_group: str | int | None = None):
        self.endpoint = resolve_endpoint(endpoint, os.environ)
        self.trust = Trust.of(daemon_group, os.environ)     # who may be the daemon (trust.py)
        self.hit_path, self.hit_path_why = hit_path_mode(hit_path, os.environ)
        self._hits: LocalHits | None = None     # the shared index, while attached with the hit path
        self._views: dict = {}          # (slot, layer or -1, tensor) -> view (views.py)
        self.name = name or f"pid-{os.getpid()}"
        self.timeout = timeout
        self.reconnect_timeout = reconnect_timeout   # 0: raise DaemonRestarted at once
        self.restarts = 0                            # re-attachments so far
        self.gen = None
        self.layout = None
        self.layouts: dict[int, list[TensorSpec]] = {}   # every layer's layout when layers differ, else {}
        self._mm = None
        # callables(mmap) run before an arena mapping is unmapped (close, a re-attach): a GPU
        # runtime unregisters it there (k3client/gpu/pinning.py); they must not raise
        self.before_unmap: list = []
        self._ctx = zmq.Context()
        self._chan: Channel | None = None    # the connection to the daemon attached now
        self._pending: int | None = None     # id of a begin_token(wait=False) whose reply is not read
        self._done: dict[int, None] = {}     # released layers for the next message, without the hit path
        self._stream = None                  # the fetch_iter in progress (stream.py); another request, or
                                             # the release of its layer, ends it
        # Expired Experts (views.py): every fetch call's number, the number at the last
        # begin_token/close, and per released layer the number at its release this token
        self._seq = self._expired = 0
        self._released: dict[int, int] = {}
        self._hb_stop = threading.Event()
        self._hb_wake = threading.Event()    # set: beat now (a new lease, or stop)
        self._io = threading.RLock()         # the request socket (module docstring)
        self._closed = False
        self._hb_thread = None
        try:
            self._connect_waiting(connect_timeout, wait)
            # The lease thread holds only a weak reference: a Client dropped without
            # close() (and with no Expert left) stops heartbeating, so its pins expire.
            self._hb_thread = threading.Thread(
                target=heartbeat, name="k3client-lease", daemon=True,
                args=(weakref.ref(self), self._ctx, self.endpoint, max(0.2, self.lease_s / 4),
                      self._hb_stop, self._hb_wake))
            self._hb_thread.start()
            weakref.finalize(self, end_heartbeat, self._hb_stop, self._hb_wake)
        except BaseException:
            self._teardown()
            raise

    # -- connection ---------------------------------------------------------
    def _connect_waiting(self, connect_timeout: float, wait: float) -> None:
        """``_connect``; with ``wait`` > 0, retried while the daemon is starting or not there yet."""
        deadline = time.monotonic() + wait
        while True:
            try:
                self._connect(connect_timeout)
                return
            except (errors.Starting, errors.DaemonNotRunning) as e:
                self._disconnect()
                if time.monotonic() >= deadline:
                    if wait and isinstance(e, errors.Starting):
                        raise errors.Starting(f"{e} (waited {wait:g}s)") from None
                    raise
                time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    def _connect(self, connect_timeout: float):
        """One attempt: a new channel, hello, the arena's memfd."""
        path = ipc_path(self.endpoint)
        if path is not None and not os.path.exists(path):
            blocked = unreachable_dir(path)
            if blocked:
                raise errors.PermissionDenied(no_access_message(path, blocked))
            raise errors.DaemonNotRunning(
                f"k3d daemon not running at {self.endpoint}: no socket {path} (start it with `k3d start`)")
        self._chan = Channel(self._ctx, self.endpoint)
        self.gen = None
        try:
            self._asked_hit_path = self.hit_path == "client"
            h = self._chan.request("hello", connect_timeout, name=self.name, pid=os.getpid(),
                                   hit_path=self._asked_hit_path)
        except errors.Timeout:
            raise errors.DaemonNotRunning(
                f"k3d daemon not running at {self.endpoint}: no answer in {connect_timeout:g}s") from None
        arena_socket = self.trust.hello_peer(self._chan.peer, self.endpoint, h["arena_socket"])
        layout = [TensorSpec.from_wire(w) for w in h["layout"]]
        layouts = layouts_from_wire(h["model"].get("layouts"))
        if self.layout is not None and (layout != self.layout or h["expert_bytes"] != self.expert_bytes
                                        or layouts != self.layouts):
            raise _LayoutChanged(
                f"the daemon at {self.endpoint} came back serving a different expert layout "
                f"({h['model'].get('path')}); connect again")
        self.gen = h["gen"]
        self.client_id = h["client_id"]
        # One tuple, assigned at once: the lease thread must never pair this
        # attachment's id with another's generation (it would renew a stranger).
        self._lease = (self.client_id, self.gen)
        self.layout = layout
        self._specs = {s.name: s for s in self.layout}
        self.layouts = layouts
        self._layer_specs = {l: {s.name: s for s in lay} for l, lay in layouts.items()}
        self.model = h["model"]
        self.slots = h["slots"]
        self.slot_bytes = h["slot_bytes"]
        self.expert_bytes = h["expert_bytes"]
        self.lease_s = h["lease_s"]
        self.pin_quota = h.get("pin_quota", 0)
        self._hb_wake.set()         # a (re)attach: beat now, at this daemon's lease from here on
        self._attach_arena(arena_socket, h["arena_bytes"], h["index_bytes"])
        if self._asked_hit_path and self._hits is None:
            # The index could not be mapped: the daemon counts this client as one that
            # reads it, and would wait for its index counts.  Say hello again without.
            h = self._chan.request("hello", connect_timeout, name=self.name, pid=os.getpid(), hit_path=False)
            self.client_id = h["client_id"]
            self._lease = (self.client_id, self.gen)

    def _disconnect(self) -> None:
        with self._io:
            self._pending = None             # its reply would come on the channel closed here
            if self._chan is not None:
                self._chan.close()
                self._chan = None
            self._views.clear()
            if self._hits is not None:        # its reports were for the daemon that went away
                self._hits.close()
                self._hits = None
        if self._mm is not None:
            try:
                for hook in self.before_unmap:
                    hook(self._mm)
            finally:
                try:
                    self._mm.close()
                except BufferError:
                    pass  # views still alive; the old mapping goes when they do
                self._mm = None

    def _reattach(self, why: str) -> None:
        """Attach to the restarted daemon within ``reconnect_timeout`` or raise."""
        old = self.gen
        self._disconnect()
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
                self._connect(min(left, 2.0))
                break
            except (_LayoutChanged, errors.Untrusted):   # no arena, no channel: nothing to read
                self._disconnect()
                self.gen = None
                raise
            except (errors.DaemonNotRunning, errors.DaemonRestarted, errors.ShuttingDown, errors.Timeout,
                    errors.Starting):
                self._disconnect()
                self.gen = old
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        self.restarts += 1

    def _attach_arena(self, path: str, size: int, index_size: int):
        self._mm, index_fd = handout.receive(path, size, self.gen, self.trust, (self._chan.peer or (0, 0, None))[2])
        if index_fd is None:
            return
        try:
            if self.hit_path == "client" and self._hits is None:
                self._hits = LocalHits(index_fd, index_size, self._chan.pidfd, self.pin_quota)
        except (OSError, ValueError) as e:
            self.hit_path, self.hit_path_why = "daemon", f"cannot map the shared index: {e}"
        finally:
            os.close(index_fd)

    def _call(self, op: str, **fields):
        """``Channel.request`` with this client's hit reports, re-attaching and re-issuing it
        across daemon restarts (without the reports meant for the daemon that went away);
        ``SlotsBusy`` is retried.  The hit path's window is shut from the send until the
        reply, and stays shut if anything goes wrong (``hits.py``)."""
        if self._closed:
            raise errors.K3Error(f"{op}: this client is closed; call k3client.connect() again")
        self._stream = None
        self.settle()
        deadline = time.monotonic() + self.timeout
        pause = 0.0005
        while True:
            if self._chan is None:
                self._reattach("not attached")
                continue
            hits = self._hits
            fields.pop("hits", None)          # a retry's were applied with the first try
            fields.pop("done", None)
            try:
                with self._io:
                    rid = self._post(hits, op, fields)
                    reply = self._chan.wait(rid, op, self.timeout)
            except Gone as e:
                self._reattach(str(e))
                continue
            except errors.SlotsBusy:
                # Evicted slots wait until other clients' views of them end (their next
                # message): the daemon makes room meanwhile.
                if time.monotonic() + pause > deadline:
                    if hits is not None:
                        hits.failed()
                    raise
                time.sleep(pause)
                pause = min(0.05, pause * 2)
                continue
            except BaseException:             # Timeout, an error reply, KeyboardInterrupt, ...
                if hits is not None:
                    hits.failed()
                raise
            if hits is not None and hits is self._hits:
                hits.open = True
            return reply

    def _post(self, hits, op: str, fields: dict) -> int:
        """Under ``_io``: send ``op`` with ``fields`` plus what every message carries
        (``_outgoing``); returns its request id.  The local-hit window shuts first (C1).  If
        the message does not leave, the reports taken for it go first in the next one
        (``LocalHits.failed``, still under ``_io``: the lease thread must not send a count
        before they go again).  A ``begin_token`` that left starts the new token's counts."""
        try:
            if hits is not None:
                hits.open = False
            fields.update(self._outgoing(hits))
            rid = self._chan.post(op, **fields)
        except BaseException:
            if hits is not None:
                hits.failed()
            raise
        if hits is not None:
            hits.sent()
            if op == "begin_token":
                hits.new_token()
        if op == "begin_token":
            self._done = {}
        return rid

    def _outgoing(self, hits) -> dict:
        """Under ``_io``: what the next message carries besides its op's fields: the hit
        reports (``LocalHits.take``) and the layers released since the last message (``done``)."""
        if hits is not None:
            return hits.take()
        done, self._done = self._done, {}
        return {"done": list(done)} if done else {}

    def _lease_sync(self) -> None:
        """On the lease thread: send the hit reports and the index count seen (``LocalHits.sync``)
        unless the client's thread is using the request socket (its message carries them)."""
        hits, chan = self._hits, self._chan
        if hits is None or chan is None or not self._io.acquire(blocking=False):
            return
        try:
            if self._hits is hits and self._chan is chan:
                fields = hits.sync()
                if fields:
                    chan.send("hits", **fields)
                    hits.sent()
        except zmq.ZMQError:
            hits.unsend()                     # a closing socket: the client's thread carries on
        finally:
            self._io.release()

    # -- public API ---------------------------------------------------------
    @property
    def arena(self):
        """The read-only mapping of the attached daemon's arena (None while detached); a
        re-attach maps a new one (compare ``gen``)."""
        return self._mm

    def layout_of(self, layer: int) -> list[TensorSpec]:
        """Layer ``layer``'s expert layout: ``layout`` unless the model's layers differ
        (``layouts`` then holds every layer's; ``Expert.array`` uses its own layer's)."""
        return self.layouts.get(layer, self.layout)

    def _specs_of(self, layer: int) -> dict[str, TensorSpec]:
        return self._layer_specs.get(layer, self._specs)

    def begin_token(self, wait: bool = True) -> int | None:
        """Start the next epoch; the previous epoch's pins (and views) are released.

        ``wait=False`` sends the request and returns None at once; its reply is collected by
        ``settle()``, which every other call of this client makes first (``fetch`` before it
        answers a hit from the shared index, too).  So no view is handed out before the
        daemon has started the epoch, and the pin and reuse rules are a waited
        ``begin_token``'s; what it saves is the wait, overlapped with the caller's work
        until its next call.  A restart found then re-attaches and begins the epoch there.
        Every ``Expert`` fetched before this call builds no view after it (``Expired``)."""
        self.settle()
        self._expired = self._seq            # from here on, no Expert fetched before builds a view
        self._released.clear()
        hits = self._hits
        if wait or self._chan is None or self._closed:
            return self._call("begin_token")["epoch"]
        self._stream = None
        with self._io:                       # the window stays shut until settle() reads the reply
            self._pending = self._post(hits, "begin_token", {})
        return None

    def settle(self) -> None:
        """Read the reply of an outstanding ``begin_token(wait=False)``, if any."""
        rid, self._pending = self._pending, None
        if rid is None or self._chan is None:
            return
        hits = self._hits
        try:
            with self._io:
                self._chan.wait(rid, "begin_token", self.timeout)
        except Gone as e:
            self._reattach(str(e))
            self._call("begin_token")       # the epoch begins on the daemon attached now
            return
        except BaseException:
            if hits is not None:
                hits.failed()
            raise
        if hits is not None and hits is self._hits:
            hits.open = True

    def fetch(self, layer: int, experts, predicted=None) -> list[Expert]:
        """Experts of ``layer`` in request order, once all are in the arena.

        Layers and experts are integers (``int``, numpy or torch integer scalars);
        anything else, ``bool`` included, is refused with ``BadRequest`` before sending."""
        layer, experts, preds, local = self._local(layer, experts, predicted)
        if local is not None:
            return local
        fields = {"keys": [[layer, e] for e in experts]}
        if preds:
            fields["predicted"] = preds
        slots = self._call("fetch", **fields)["slots"]
        if self._hits is not None:           # the session that answered (after a re-attach, a new one)
            self._hits.held_by_daemon(slots, layer)
        return [Expert(self, layer, e, s) for e, s in zip(experts, slots)]

    def fetch_iter(self, layer: int, experts, predicted=None):
        """``(index, Expert)`` for each of ``experts`` of ``layer`` as it becomes ready:
        the resident ones at once, then the others as their reads finish (``index``:
        its position in ``experts``; each once).  Every expert yielded is pinned as
        ``fetch``'s are, until the next ``begin_token()``.  Arguments and errors as
        ``fetch``'s (bad arguments raise here, before any iteration); ``timeout`` bounds
        the wait for each part, not the caller's work between them.  The iterator
        must be used up before this client's next call; another call ends it (its
        next step raises ``K3Error``).  Leaving the loop early, or an exception in
        it, keeps the hit path shut until the next request: what was yielded stays
        valid (``stream.py``)."""
        layer, experts, preds, local = self._local(layer, experts, predicted)
        if local is not None:
            return iter(enumerate(local))
        if self._closed:
            raise errors.K3Error("fetch_iter: this client is closed; call k3client.connect() again")
        return stream(self, layer, experts, preds)

    def _local(self, layer, experts, predicted):
        """The checked ``(layer, experts, predictions)`` and, when the shared index
        answers the fetch, its Experts (else None: the daemon must)."""
        # The common case (an int layer, a list of ints) is checked with a few builtins:
        # on the hit path this check is a good part of what a fetch costs.
        if type(layer) is not int:
            layer = key_int("layer", layer)
        if type(experts) is list and _INTS.issuperset(map(type, experts)):
            experts = list(experts)          # a copy: the caller may reuse its list
        else:
            experts = [key_int("expert", e) for e in items("experts", experts)]
        preds = key_pairs("predicted", predicted) if predicted else []
        self._seq += 1                       # this fetch's Experts (views.py: Expired)
        if self._pending is not None:
            self.settle()                    # the epoch has begun before a view is answered here
        hits = self._hits
        if hits is not None:
            # Predictions of keys not resident go with a fetch through the daemon: a slot
            # they evict is reused at once only while this client waits for the reply.
            if preds:
                preds = hits.not_resident(preds)
            slots = None if preds else hits.answer(layer, experts)
            if slots is not None:
                if hits.reported >= REPORT_FLUSH:
                    with self._io:
                        fields = hits.take()
                        if fields:
                            try:
                                self._chan.send("hits", **fields)
                                hits.sent()
                            except BaseException:
                                hits.unsend()
                                raise
                return layer, experts, preds, [Expert(self, layer, e, s) for e, s in zip(experts, slots)]
        return layer, experts, preds, None

    def release_layer(self, layer) -> None:
        """Say that this client is done with ``layer`` for the current token: the daemon
        unpins the slots of ``layer`` it holds for this token (and stops keeping those it
        reported reading from reuse), so other clients' misses may evict them before this
        client's next ``begin_token()``.  Its predictions not fetched yet stay pinned.
        Nothing is sent now: the next message carries it (a fetch that misses, the lease
        thread's report within a quarter lease), after that message's hit reports.

        The caller's obligation: no view of ``layer`` obtained in this token (``fetch``,
        ``fetch_iter``) is read again after this call (on a GPU, the copies from them are
        complete).  A later fetch of ``layer`` in the same token is fine: it is pinned
        afresh (one answered from the shared index before the release leaves cancels it).
        A ``fetch_iter`` of ``layer`` still running ends here (its next step raises
        ``K3Error``): the release unpins what it has yet to yield.  What the client
        enforces: an ``Expert`` of ``layer`` fetched before this call builds no view after
        it (``Expired``, ``views.py``)."""
        layer = key_int("layer", layer)
        self._released[layer] = self._seq    # its Experts fetched so far build no view
        if self._stream is not None and self._stream.layer == layer:
            self._stream = None
        if self._hits is not None:
            self._hits.release(layer)
        else:
            self._done[layer] = None

    def layer_resident(self, layer: int, n: int) -> bool:
        """Whether the shared index shows experts 0..n-1 of ``layer`` all resident (or being
        read), so that predicting any of them would send nothing: a hint, no request.  False
        without the client's hit path (the daemon then judges each prediction)."""
        return self._hits is not None and self._hits.layer_resident(layer, n)

    def predict(self, keys) -> int:
        """Queue background reads for ``[(layer, expert), ...]``; returns how many were queued
        (keys already resident are not: with the shared index, nothing is sent for them)."""
        keys = key_pairs("keys", keys)
        if self._hits is not None:
            keys = self._hits.not_resident(keys)
            if not keys:
                return 0
        return self._call("predict", keys=keys)["queued"]

    def status(self) -> dict:
        return self._call("status")["status"]

    def verify(self, path: str) -> dict:
        """Raise ``Mismatch`` (one line) unless the checkpoint at ``path`` holds the experts
        this daemon serves: same layout and the same sampled bytes (``k3client.verify``);
        returns the digest both share."""
        from .verify import verify
        return verify(self, path)

    def close(self):
        """Say bye (the daemon releases this client's pins) and release the mapping. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._expired = self._seq
        self._pending = None             # bye's wait skips that reply
        self._stream = None
        if self._chan is not None:
            try:
                with self._io:
                    self._chan.request("bye", 1.0, **(self._hits.take() if self._hits is not None else {}))
            except errors.K3Error:
                pass
        self._teardown()
        self.gen = None

    def _teardown(self):
        end_heartbeat(self._hb_stop, self._hb_wake)
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=2)
        self._disconnect()
        self._ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def connect(endpoint: str | None = None, name: str | None = None, **kw) -> Client:
    """Attach to the daemon and map its arena; returns a ``Client`` (a context manager).

    - ``endpoint``: ``ipc:///path/k3d.sock`` or ``tcp://host:port``; default ``K3D_ENDPOINT``,
      else ``ipc://$XDG_RUNTIME_DIR/k3d/k3d.sock`` (``ipc:///tmp/k3d-$UID/k3d.sock``).
    - ``name``: shown in ``k3ctl status`` and the daemon's log (default ``pid-<pid>``).
    - ``timeout`` (120 s): longest wait for one reply (a fetch of cold experts included).
    - ``connect_timeout`` (5 s): longest wait for the daemon's answer to hello.
    - ``reconnect_timeout`` (30 s): after a daemon restart, how long a request keeps
      re-attaching before ``DaemonNotRunning``; 0 raises ``DaemonRestarted`` at once.
    - ``wait`` (0 s): how long to wait for a daemon that is still starting (pre-faulting
      its arena: ``Starting`` says how far) or whose socket is not there yet; 0 raises at once.
    - ``hit_path`` (``K3D_HIT_PATH``, default ``"client"``): ``"client"`` answers fetches of
      resident experts from the shared index without a message; ``"daemon"`` sends every
      fetch to the daemon (forced where the CPU lacks the ordering the index needs).
    - ``daemon_group`` (``K3D_DAEMON_GROUP``): the daemon may run as a member of this group
      (a name or gid), besides this user and root; needed for a daemon of another user.

    Raises ``DaemonNotRunning`` (nothing listens), ``Starting`` (still starting, after ``wait``),
    ``PermissionDenied`` (not the daemon's user or group), ``Untrusted`` (what answers is not
    shown to be a daemon of a trusted user, with sealed memory: ``k3client/trust.py``),
    ``ProtocolMismatch`` (k3client and k3d versions differ)."""
    return Client(endpoint=endpoint, name=name, **kw)

