"""The model-process side: connect, fetch experts, read them zero-copy.

Thread-safety: a ``Client`` is used from one thread (its DEALER socket is not
thread-safe).  A second, private thread sends lease heartbeats on its own
socket so a live but busy process keeps its pins; a hung or stopped process
stops heartbeating and the daemon releases its pins after ``lease_s``.

Caller's obligations: a view returned by ``Expert.array``/``Expert.tensor`` is
valid until this client's next ``begin_token()`` (the daemon keeps the slot
pinned until then) or ``close()``.  Views are read-only; the mapping is
PROT_READ and the memfd is sealed, so a write through a numpy view raises
``ValueError`` and a write through a torch view faults the process.
"""

from __future__ import annotations

import itertools
import mmap
import os
import socket
import threading
import time
import warnings

import numpy as np
import zmq

from . import errors
from .endpoint import ipc_path, resolve_endpoint
from .layout import DTYPES, TensorSpec, numpy_dtype
from .protocol import MAX_MESSAGE_BYTES, PROTOCOL_VERSION, pack, unpack

_UNSET = object()


class Expert:
    """One fetched expert: ``layer``, ``expert``, ``slot``; views into the arena."""

    __slots__ = ("layer", "expert", "slot", "_client")

    def __init__(self, client: "Client", layer: int, expert: int, slot: int):
        self.layer, self.expert, self.slot, self._client = layer, expert, slot, client

    def __repr__(self):
        return f"Expert(layer={self.layer}, expert={self.expert}, slot={self.slot})"

    def _spec(self, name: str) -> TensorSpec:
        try:
            return self._client._specs[name]
        except KeyError:
            raise KeyError(f"no tensor {name!r} in the layout; have {sorted(self._client._specs)}") from None

    def memory(self) -> memoryview:
        """Read-only view of the whole expert span in its slot."""
        c = self._client
        base = self.slot * c.slot_bytes
        return memoryview(c._mm)[base:base + c.expert_bytes]

    def array(self, name: str) -> np.ndarray:
        """Read-only numpy view of one tensor (bf16/fp8 as same-width uints)."""
        spec = self._spec(name)
        dt = numpy_dtype(spec.dtype)
        off = self.slot * self._client.slot_bytes + spec.offset
        return np.frombuffer(self._client._mm, dtype=dt, count=spec.nbytes // dt.itemsize,
                             offset=off).reshape(spec.shape)

    def tensor(self, name: str):
        """torch view of one tensor, no copy (needs torch). Do not write to it."""
        import torch

        spec = self._spec(name)
        tdt = getattr(torch, DTYPES[spec.dtype][2])
        off = self.slot * self._client.slot_bytes + spec.offset
        with warnings.catch_warnings():
            # torch warns that the buffer is not writable; that is the point.
            warnings.simplefilter("ignore", UserWarning)
            t = torch.frombuffer(self._client._mm, dtype=tdt,
                                 count=spec.nbytes // DTYPES[spec.dtype][0], offset=off)
        return t.view(spec.shape)


class Client:
    """A connection to the k3d daemon.  Use ``k3client.connect``."""

    def __init__(self, endpoint: str | None = None, name: str | None = None,
                 timeout: float = 120.0, connect_timeout: float = 5.0):
        self.endpoint = resolve_endpoint(endpoint, os.environ)
        self.name = name or f"pid-{os.getpid()}"
        self.timeout = timeout
        self._ids = itertools.count(1)
        self._mm = None
        self._ctx = zmq.Context()
        self._sock = None
        self._hb_stop = threading.Event()
        self._hb_thread = None
        try:
            self._connect(connect_timeout)
        except BaseException:
            self._teardown()
            raise

    # -- connection ---------------------------------------------------------
    def _connect(self, connect_timeout: float):
        path = ipc_path(self.endpoint)
        if path is not None and not os.path.exists(path):
            raise errors.DaemonNotRunning(
                f"k3d daemon not running at {self.endpoint}: no socket {path} (start it with `k3d start`)")
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 64 * MAX_MESSAGE_BYTES)
        self._sock.connect(self.endpoint)
        self.gen = None
        try:
            h = self._request("hello", timeout=connect_timeout, name=self.name, pid=os.getpid())
        except errors.Timeout:
            raise errors.DaemonNotRunning(
                f"k3d daemon not running at {self.endpoint}: no answer in {connect_timeout:g}s") from None
        self.gen = h["gen"]
        self.client_id = h["client_id"]
        self.layout = [TensorSpec.from_wire(w) for w in h["layout"]]
        self._specs = {s.name: s for s in self.layout}
        self.model = h["model"]
        self.slots = h["slots"]
        self.slot_bytes = h["slot_bytes"]
        self.expert_bytes = h["expert_bytes"]
        self.lease_s = h["lease_s"]
        self._attach_arena(h["arena_socket"], h["arena_bytes"])
        self._hb_thread = threading.Thread(target=self._heartbeat, name="k3client-lease", daemon=True)
        self._hb_thread.start()

    def _attach_arena(self, path: str, size: int):
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.settimeout(5.0)
            try:
                s.connect(path)
                msg, fds, _, _ = socket.recv_fds(s, 4096, 1)
            except OSError as e:
                raise errors.DaemonNotRunning(f"cannot attach the arena at {path}: {e}") from None
        if not fds:
            raise errors.PermissionDenied(f"the daemon refused to hand out the arena at {path}: {msg.decode(errors='replace')}")
        fd = fds[0]
        try:
            meta = unpack(msg)
            if meta["gen"] != self.gen:
                raise errors.DaemonRestarted("the daemon restarted while attaching; connect again")
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)

    def _heartbeat(self):
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self.endpoint)
        period = max(0.2, self.lease_s / 4)
        try:
            while not self._hb_stop.wait(period):
                s.send(pack({"v": PROTOCOL_VERSION, "op": "heartbeat", "id": 0,
                             "client_id": self.client_id}), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        finally:
            s.close(0)

    def _request(self, op: str, timeout=_UNSET, **fields):
        rid = next(self._ids)
        msg = {"v": PROTOCOL_VERSION, "op": op, "id": rid}
        msg.update(fields)
        self._sock.send(pack(msg))
        timeout = self.timeout if timeout is _UNSET else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait_ms = -1 if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            if not self._sock.poll(wait_ms):
                raise errors.Timeout(f"{op}: no reply from {self.endpoint} in {timeout:g}s")
            reply = unpack(self._sock.recv())
            if reply.get("id") != rid:
                continue  # a late reply to a request that timed out earlier
            if self.gen is not None and reply.get("gen") != self.gen:
                raise errors.DaemonRestarted(
                    f"the daemon at {self.endpoint} restarted (generation changed); reconnect")
            if not reply.get("ok"):
                e = reply.get("error") or {}
                raise errors.from_wire(e.get("code", "error"), e.get("message", "unknown error"))
            return reply

    # -- public API ---------------------------------------------------------
    def begin_token(self) -> int:
        """Start the next epoch; the previous epoch's pins (and views) are released."""
        return self._request("begin_token")["epoch"]

    def fetch(self, layer: int, experts, predicted=None) -> list[Expert]:
        """Experts of ``layer`` in request order, once all are in the arena."""
        experts = [int(e) for e in experts]
        keys = [[int(layer), e] for e in experts]
        fields = {"keys": keys}
        if predicted:
            fields["predicted"] = [[int(l), int(e)] for l, e in predicted]
        slots = self._request("fetch", **fields)["slots"]
        return [Expert(self, int(layer), e, s) for e, s in zip(experts, slots)]

    def predict(self, keys) -> int:
        """Queue background reads for ``[(layer, expert), ...]``; returns how many were queued."""
        return self._request("predict", keys=[[int(l), int(e)] for l, e in keys])["queued"]

    def status(self) -> dict:
        r = self._request("status")
        return r["status"]

    def close(self):
        if self._sock is not None:
            try:
                self._request("bye", timeout=1.0)
            except errors.K3Error:
                pass
        self._teardown()

    def _teardown(self):
        self._hb_stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=2)
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # views still alive; the mapping goes when they do
            self._mm = None
        self._ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def connect(endpoint: str | None = None, name: str | None = None, **kw) -> Client:
    """Connect to the daemon at ``endpoint`` (default: ``K3D_ENDPOINT`` or the per-user socket)."""
    return Client(endpoint=endpoint, name=name, **kw)
