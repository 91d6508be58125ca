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
(``k3d/cache/reuse.py``, which states the client's obligations; ``hits.py``,
``attachment.py`` and this module meet them).  A process that exits, or stops heartbeating for
``lease_s``, loses its pins.  Views are read-only; the mapping is PROT_READ and
the memfd is sealed, so a write through a numpy view raises ``ValueError`` and a
write through a torch view faults the process.

The attachment: what a client holds of the daemon it is attached to (the
connection, the session and its lease, the layout, the arena mapping and its
views, the shared index) and what every message carries is its ``Attachment``
(``attachment.py``, which also states how a daemon restart is noticed, what a
re-attach verifies, and why an ``Expert`` of an older generation refuses).  The
``Client`` holds one for its life and keeps the request API: it shapes each
request, opens the hit path's window on a reply, retries ``SlotsBusy``, and
re-issues a request across a re-attach (``_call``).  The attachment's
attributes (``gen``, ``layout``, ``model``, ``restarts``, ...) read through the
client (``Attached``).  Owner: the client's thread; its lease thread only as
``attachment.py`` says.
"""

from __future__ import annotations

import os
import threading
import time
import weakref

import zmq

from . import errors
from .attachment import Attached, Attachment
from .channel import Gone
from .endpoint import resolve_endpoint
from .hits import REPORT_FLUSH, hit_path_mode
from .layout import TensorSpec
from .lease import end_heartbeat, heartbeat
from .protocol import items, key_int, key_pairs
from .stream import stream
from .trust import Trust
from .views import Expert

_INTS = frozenset((int,))


class Client:
    """A connection to the k3d daemon.  Use ``k3client.connect``."""

    # What the client holds of the daemon attached now is its attachment's (``_at``,
    # attachment.py, which says what each is); these read and set it there.
    endpoint = Attached()
    name = Attached()
    trust = Attached()                 # who may be the daemon (trust.py)
    hit_path = Attached()              # "client" or "daemon"; hit_path_why: why "daemon"
    hit_path_why = Attached()
    reconnect_timeout = Attached()     # 0: raise DaemonRestarted at once
    restarts = Attached()              # re-attachments so far
    gen = Attached()                   # the daemon's generation (None: detached)
    client_id = Attached()
    layout = Attached()
    layouts = Attached()               # every layer's layout when layers differ, else {}
    model = Attached()
    slots = Attached()
    slot_bytes = Attached()
    expert_bytes = Attached()
    lease_s = Attached()
    pin_quota = Attached()
    before_unmap = Attached()          # callables(mmap) run before an arena mapping is unmapped
    _hits = Attached("hits")           # the shared index, while attached with the hit path
    _chan = Attached("chan")           # the connection to the daemon attached now
    _lease = Attached("lease")         # (client_id, gen): what the lease thread renews (lease.py)

    def __init__(self, endpoint: str | None = None, name: str | None = None,
                 timeout: float = 120.0, connect_timeout: float = 5.0,
                 reconnect_timeout: float = 30.0, wait: float = 0.0, hit_path: str | None = None,
                 daemon_group: str | int | None = None):
        endpoint = resolve_endpoint(endpoint, os.environ)
        trust = Trust.of(daemon_group, os.environ)
        mode = hit_path_mode(hit_path, os.environ)
        self.timeout = timeout
        self._ctx = zmq.Context()
        self._hb_stop = threading.Event()
        self._hb_wake = threading.Event()    # set: beat now (a new lease, or stop)
        self._at = Attachment(self._ctx, endpoint, name or f"pid-{os.getpid()}", trust, mode,
                              reconnect_timeout, self._hb_wake, threading.RLock())
        self._pending: int | None = None     # id of a begin_token(wait=False) whose reply is not read
        self._stream = None                  # the fetch_iter in progress (stream.py); another request, or
                                             # the release of its layer, ends it
        # Expired Experts (views.py): every fetch call's number, the number at the last
        # begin_token/close, and per released layer the number at its release this token
        self._seq = self._expired = 0
        self._released: dict[int, int] = {}
        self._closed = False
        self._hb_thread = None
        try:
            self._at.connect_waiting(connect_timeout, wait)
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

    # -- requests ---------------------------------------------------------
    def _reattach(self, why: str) -> None:
        """``Attachment.reattach``; a reply awaited on the old channel will never come."""
        self._pending = None
        self._at.reattach(why)

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
            if self._at.chan is None:
                self._reattach("not attached")
                continue
            hits = self._at.hits
            fields.pop("hits", None)          # a retry's were applied with the first try
            fields.pop("done", None)
            try:
                with self._at.io:
                    rid = self._at.post(hits, op, fields)
                    reply = self._at.chan.wait(rid, op, self.timeout)
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
            if hits is not None and hits is self._at.hits:
                hits.open = True
            return reply

    def _lease_sync(self) -> None:
        """On the lease thread (``lease.py``): ``Attachment.lease_sync``."""
        self._at.lease_sync()

    # -- public API ---------------------------------------------------------
    @property
    def arena(self):
        """The read-only mapping of the attached daemon's arena (None while detached); a
        re-attach maps a new one (compare ``gen``)."""
        return self._at.mm

    def layout_of(self, layer: int) -> list[TensorSpec]:
        """Layer ``layer``'s expert layout: ``layout`` unless the model's layers differ
        (``layouts`` then holds every layer's; ``Expert.array`` uses its own layer's)."""
        return self._at.layout_of(layer)

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
        hits = self._at.hits
        if wait or self._at.chan is None or self._closed:
            return self._call("begin_token")["epoch"]
        self._stream = None
        with self._at.io:                       # the window stays shut until settle() reads the reply
            self._pending = self._at.post(hits, "begin_token", {})
        return None

    def settle(self) -> None:
        """Read the reply of an outstanding ``begin_token(wait=False)``, if any."""
        rid, self._pending = self._pending, None
        if rid is None or self._at.chan is None:
            return
        hits = self._at.hits
        try:
            with self._at.io:
                self._at.chan.wait(rid, "begin_token", self.timeout)
        except Gone as e:
            self._reattach(str(e))
            self._call("begin_token")       # the epoch begins on the daemon attached now
            return
        except BaseException:
            if hits is not None:
                hits.failed()
            raise
        if hits is not None and hits is self._at.hits:
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
        if self._at.hits is not None:           # the session that answered (after a re-attach, a new one)
            self._at.hits.held_by_daemon(slots, layer)
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
        hits = self._at.hits
        if hits is not None:
            # Predictions of keys not resident go with a fetch through the daemon: a slot
            # they evict is reused at once only while this client waits for the reply.
            if preds:
                preds = hits.not_resident(preds)
            slots = None if preds else hits.answer(layer, experts)
            if slots is not None:
                if hits.reported >= REPORT_FLUSH:
                    self._at.send_reports(hits)
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
        self._at.check_layer(layer, "release_layer")
        self._released[layer] = self._seq    # its Experts fetched so far build no view
        if self._stream is not None and self._stream.layer == layer:
            self._stream = None
        self._at.release(layer)

    def layer_resident(self, layer: int, n: int) -> bool:
        """Whether the shared index shows experts 0..n-1 of ``layer`` all resident (or being
        read), so that predicting any of them would send nothing: a hint, no request.  False
        without the client's hit path (the daemon then judges each prediction)."""
        return self._at.hits is not None and self._at.hits.layer_resident(layer, n)

    def predict(self, keys) -> int:
        """Queue background reads for ``[(layer, expert), ...]``; returns how many were queued
        (keys already resident are not: with the shared index, nothing is sent for them)."""
        keys = key_pairs("keys", keys)
        if self._at.hits is not None:
            keys = self._at.hits.not_resident(keys)
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
        self._at.bye()
        self._teardown()
        self._at.gen = None

    def _teardown(self):
        end_heartbeat(self._hb_stop, self._hb_wake)
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=2)
        self._pending = None
        self._at.detach()
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

