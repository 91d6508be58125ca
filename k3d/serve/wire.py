"""The ROUTER socket and the message rules: decode a request, check its keys, send replies.

Request: one msgpack frame after the routing id, a map ``{v, op, id, ...}``
(``k3client/protocol.py``), at most ``MAX_MESSAGE_BYTES`` (1 MiB).  Reply: ``{id, ok:
true, gen, ...fields}`` or ``{id, ok: false, gen, error: {code, message}}``;
``gen`` names this daemon's run (a client sees a restart).  An error message is
one line, cut to 1 KiB (it may quote client input; replies stay within the
clients' decode limits).

``open_endpoint`` binds the socket (the daemon, before start-up);
``decode`` and ``keys`` raise the typed errors of ``k3client.errors``; the
loop turns them into replies.  ``Replies`` never waits to send (nothing a
client does stops the loop), so a reply ZeroMQ will not take is dropped:
- to a peer that is gone (ROUTER_MANDATORY): nobody waits for it; a debug line;
- to a peer whose queue is at the send high-water mark (it is not reading its
  replies): counted (``dropped``, status ``stats.replies_dropped``) and logged
  as a warning, once per peer until a reply to it gets through again.  No error
  reply can reach it then: its queue is the one that is full;
- a reply that cannot be encoded, or is larger than a client's socket accepts
  (``MAX_REPLY_BYTES``), would leave its client waiting its whole timeout: an
  error reply with the same id goes instead, counted and logged too.

Limits, per client (ZeroMQ counts its high-water marks per peer), set on the socket by
``open_endpoint`` so that nothing a client sends grows the daemon without bound:
- ``MAXMSGSIZE`` = ``MAX_MESSAGE_BYTES``: libzmq ends the connection of a peer that
  sends a larger frame before the loop sees it; that request is never answered
  and the peer's socket reconnects (``k3client`` refuses to send one: ``BadRequest``);
- ``MAX_QUEUED`` requests waiting for their turn in the loop: one more is answered
  at once with a one-line ``bad_request``, its hit reports applied (``intake.py``,
  "Bounded intake");
- ``RCVHWM`` = ``MAX_QUEUED``: beyond what the loop took, at most this many of a
  client's messages wait in the daemon; past it ZeroMQ stops reading that peer,
  so its own sends wait (back-pressure), not the daemon's memory.  A client's
  requests in the daemon: at most ``2 * MAX_QUEUED * MAX_MESSAGE_BYTES`` (64 MiB;
  a real request is under 100 KiB);
- ``SNDHWM`` = ``REPLY_HWM`` = ``2 * MAX_QUEUED`` replies waiting for a client to read
  them: one per request it may have queued, and as many one-line refusals.  A
  ``k3client`` waits for at most two replies at a time, so only a client that
  stopped reading reaches it; its replies are then dropped (below), never waited
  for, and the daemon holds at most ``REPLY_HWM`` of its replies (a fetch's reply
  is under 25 KiB) beside what the kernel's socket buffer takes.

Thread: the server thread owns the socket once the start-up responder
(``service/starting.py``) has handed it over; these functions keep no state.

``receive`` and ``Replies`` call pyzmq's backend socket methods with plain-int
flags: its convenience layer (``send_multipart``, ``recv_multipart``, flag enums)
costs several times the send itself on a request path this short
(bench/README.md, "the loop's own cost").
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from itertools import chain, repeat
from typing import cast

import zmq

from k3client.endpoint import ipc_path
from k3client.errors import BadRequest, K3Error, ProtocolMismatch, UnknownExpert
from k3client.protocol import (
    MAX_KEYS,
    MAX_MESSAGE_BYTES,
    MAX_REPLY_BYTES,
    PROTOCOL_VERSION,
    pack,
    packer,
    unpack,
)
from k3d.serve.access import private_umask

log = logging.getLogger("k3d")

_send, _recv, _get = zmq.backend.Socket.send, zmq.backend.Socket.recv, zmq.backend.Socket.get
_NOBLOCK, _MORE_NOBLOCK = int(zmq.NOBLOCK), int(zmq.SNDMORE | zmq.NOBLOCK)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
_INT = frozenset((int,))


def receive(sock: zmq.Socket, block: bool = False):
    """The next request on ``sock``: (routing id, [body frames]) or None.  Without
    ``block`` only one waiting now; with it, one arriving within the socket's
    RCVTIMEO.  The body frames are ``zmq.Frame``s: ``hello`` and ``heartbeat`` read
    the sender's credentials from them."""
    try:
        first = _recv(sock, 0 if block else _NOBLOCK, False)
    except zmq.Again:
        return None
    frames, f = [], first
    while f.more:                 # a Frame's flag: cheaper than getsockopt(RCVMORE)
        f = _recv(sock, _NOBLOCK, False)
        frames.append(f)
    return first.bytes, frames


def more_waiting(sock: zmq.Socket) -> bool:
    """Whether another request waits on ``sock`` (cheaper than a recv failing with Again)."""
    return bool(cast(int, _get(sock, _EVENTS)) & _POLLIN)


MAX_QUEUED = 32          # a client's requests waiting for their turn, at most (k3client: <= 2)
REPLY_HWM = 2 * MAX_QUEUED  # SNDHWM, per peer: see "Limits"

WAKE_ID = b"k3d-wake"     # routing id of the loop's own waker (no client can take it: see Waker)


class Waker:
    """Wakes the loop out of a blocking receive: an empty message from an inproc
    DEALER (routing id ``WAKE_ID``) connected to the loop's ROUTER.  ``wake`` is safe
    from any thread and from a signal handler (an RLock serialises the one socket; a
    handler that interrupts a wake in the same thread only sends first).  It never
    blocks: a wake that finds the queue full is not needed.  A client connecting
    later with the same routing id is refused by the ROUTER, as any duplicate is."""

    def __init__(self, ctx: zmq.Context, router: zmq.Socket, name: str) -> None:
        endpoint = f"inproc://k3d-wake-{name}"
        router.bind(endpoint)
        self._lock = threading.RLock()
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.ROUTING_ID, WAKE_ID)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 64)
        self._sock.connect(endpoint)

    def wake(self) -> None:
        with self._lock:
            if self._sock is None:
                return
            try:
                _send(self._sock, b"", _NOBLOCK, False)
            except zmq.ZMQError:
                pass

    def close(self) -> None:
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close(0)


def open_endpoint(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """The daemon's ROUTER socket, bound to ``endpoint`` with mode 0660 (umask during bind;
    chmod in case the umask was ignored).  The daemon binds it before start-up (the
    starting responder answers on it), then hands it to the server loop."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    # the limits of the module docstring ("Limits"): per peer, set before any peer connects
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.RCVHWM, MAX_QUEUED)
    sock.setsockopt(zmq.SNDHWM, REPLY_HWM)
    sock.setsockopt(zmq.LINGER, 500)
    try:
        with private_umask():
            sock.bind(endpoint)
    except BaseException:
        sock.close(0)
        raise
    path = ipc_path(endpoint)
    if path:
        os.chmod(path, 0o660)
    return sock


def decode(frames) -> tuple[dict, int]:
    """(message, request id) of one request; raises with the id known so far.

    The id is returned separately so that an error after it was read (bad
    version, unknown op) is answered to the right request."""
    if len(frames) != 1:
        raise BadRequest(f"expected one msgpack frame, got {len(frames)}")
    try:      # (no size check: MAXMSGSIZE kept larger frames out)
        msg = unpack(frames[0].buffer)
    except Exception as e:  # noqa: BLE001 -- msgpack raises many types for bad input
        raise BadRequest(f"message is not msgpack within the decode limits ({type(e).__name__}: {e})") from None
    if not isinstance(msg, dict):
        raise BadRequest("message must be a msgpack map with v, op and id")
    rid = msg.get("id")
    if type(rid) is not int:
        raise BadRequest("field 'id' must be an integer")
    return msg, rid


def check_version(msg: dict) -> None:
    if msg.get("v") != PROTOCOL_VERSION:
        raise ProtocolMismatch(
            f"client speaks protocol {msg.get('v')!r}, this daemon speaks {PROTOCOL_VERSION}; "
            "install matching k3client and k3d versions")


def keys(msg: dict, field: str, unique: bool, source) -> list[tuple[int, int]]:
    """``msg[field]`` as a list of (layer, expert) keys ``source`` serves."""
    raw = msg.get(field)
    if not isinstance(raw, list):
        raise BadRequest(f"{field} must be a list of [layer, expert] pairs")
    if len(raw) > MAX_KEYS:
        raise BadRequest(f"{field} has {len(raw)} keys; at most {MAX_KEYS} per request")
    # Fast path for well-formed requests (every fetch and prediction: one pass, stopping
    # at the first key it would refuse); the loop below checks key by key again only to
    # name that key.  Plain tests, which the compiled build (k3d.compiled) makes C.
    # (only lists are pairs: unpacking would take a 2-byte bin or a 2-key map as one)
    known = source.keys
    out: list[tuple[int, int]] = []
    for item in raw:
        if type(item) is not list or len(item) != 2:
            break
        l, e = item[0], item[1]
        if type(l) is not int or type(e) is not int:
            break
        key = (l, e)
        if key not in known:
            break
        out.append(key)
    else:
        if not unique or len(set(out)) == len(out):
            return out
    out = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 2 and all(type(x) is int for x in item)):
            raise BadRequest(f"{field}: {item!r} is not a [layer, expert] pair of integers")
        key = (item[0], item[1])
        if key not in source.keys:
            raise UnknownExpert(source.unknown(key))
        out.append(key)
    if unique and len(set(out)) != len(out):
        seen: set[tuple[int, int]] = set()
        for dup in out:
            if dup in seen:
                break
            seen.add(dup)
        raise BadRequest(f"{field}: duplicate key (layer {dup[0]}, expert {dup[1]})")
    return out


def hits(msg: dict, source, slots: int) -> list[tuple[list[tuple[int, int]], list[int]]]:
    """``msg["hits"]``: a client's reports of fetches it answered itself, each
    ``[layer, [experts], [slots seen]]``; ``[]`` when absent.  Every key must be one
    ``source`` serves (unique within its report) and every slot one of the arena's.
    This runs for every hit every client reports, so the common case is checked with
    a few builtins over the whole message (types and ranges at once, then per report
    the layer's range and uniqueness); ``keys`` names the first bad key otherwise."""
    raw = msg.get("hits")
    if raw is None:
        return []
    if type(raw) is not list:
        raise BadRequest("hits must be a list of [layer, [experts], [slots]] reports")
    total = 0
    for item in raw:
        if not (type(item) is list and len(item) == 3 and type(item[1]) is list
                and type(item[2]) is list and len(item[1]) == len(item[2]) and item[1]):
            raise BadRequest(f"hits: {str(item)[:80]} is not a [layer, [experts], [slots]] report")
        total += len(item[1])
    if total > MAX_KEYS:
        raise BadRequest(f"hits report more than {MAX_KEYS} keys in one request")
    def in_arena(seen: list) -> bool:
        return set(map(type, seen)) <= _INT and 0 <= min(seen) and max(seen) < slots

    if not in_arena(list(chain.from_iterable([item[2] for item in raw]))):
        bad = next(item[2] for item in raw if not in_arena(item[2]))       # (named in the error)
        raise BadRequest(f"hits: slots {str(bad)[:80]} are not slots of this arena (0..{slots - 1})")
    # Set inclusion stands for the range check only once every expert is known an int
    # (True and 1.0 hash as 1 does).
    ints = set(map(type, chain.from_iterable([item[1] for item in raw]))) <= _INT
    out, dense = [], _dense(source.keys)
    for layer, experts, seen in raw:
        known = dense.get(layer) if ints and type(layer) is int else None
        if known is not None and len(es := set(experts)) == len(experts) and es <= known:
            out.append((list(zip(repeat(layer), experts)), seen))
        else:
            out.append((keys({"hits": [[layer, e] for e in experts]}, "hits", True, source), seen))
    return out


def done(msg: dict, source) -> tuple[set[int], str | None]:
    """``msg["done"]``: the layers a client is done with this token (protocol 6) that
    ``source`` serves (an empty set when absent), and the error for the rest (None if
    none).  The caller releases the good ones before it refuses the message: the client
    stopped counting their slots toward its quota when it sent them (``k3client/hits.py``),
    so keeping them pinned would refuse its later hits (nothing would keep their slots)."""
    raw = msg.get("done")
    if raw is None:
        return set(), None
    if type(raw) is not list or not set(map(type, raw)) <= _INT:
        raise BadRequest(f"done must be a list of layer numbers, not {str(raw)[:80]}")
    out = set(raw)
    bad = out - _dense(source.keys).keys()
    if bad:     # (rare: a layer whose experts are not 0..n-1 is looked up key by key)
        bad -= {layer for layer, _ in source.keys if layer in bad}
    if bad:
        return out - bad, f"done: layer {min(bad)} is not a layer of the model this daemon serves"
    return out, None


_dense_of: list = [None, 0, {}]       # (the source's key dict, its size, its _dense table)


def _dense(known: dict) -> dict[int, frozenset]:
    """Layer -> its experts {0..n-1}, for the layers whose experts are exactly 0..n-1 in
    ``known`` (every checkpoint's so far): an int key of such a layer is known when its
    expert is in the set.  Rebuilt when the dict or its size changes (keys are only ever
    added to it)."""
    if _dense_of[0] is not known or _dense_of[1] != len(known):
        per: dict[int, set] = {}
        for layer, expert in known:
            per.setdefault(layer, set()).add(expert)
        table = {layer: frozenset(es) for layer, es in per.items()
                 if max(es) == len(es) - 1 and min(es) == 0}
        _dense_of[:] = [known, len(known), table]
    return _dense_of[2]


class Replies:
    """Sends replies on the ROUTER socket, stamped with this run's ``gen``; ``dropped``
    counts the replies that did not go as they were (see the module docstring)."""

    def __init__(self, sock: zmq.Socket, gen: int) -> None:
        self.sock, self.gen = sock, gen
        self.dropped = 0
        self._pack = packer()              # (the server thread's own: a Packer is not shared)
        self._full: set[bytes] = set()     # peers warned of a full queue, until a reply gets through

    def ok(self, routing: bytes, rid, fields: dict) -> None:
        self._send(routing, {"id": rid, "ok": True, "gen": self.gen, **fields})

    def error(self, routing: bytes, rid, e: K3Error) -> None:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if len(msg) > 1024:   # messages may quote client input: keep replies within the decode limits
            msg = msg[:1021] + "..."
        self._send(routing, {"id": rid, "ok": False, "gen": self.gen,
                             "error": {"code": e.code, "message": msg}})

    def _send(self, routing: bytes, reply: dict) -> None:
        try:
            data = self._pack(reply)
            why = f"{len(data)} bytes, more than a client accepts ({MAX_REPLY_BYTES})" \
                if len(data) > MAX_REPLY_BYTES else None
        except (TypeError, ValueError, OverflowError) as e:   # msgpack's refusals: a bug in a handler
            why = f"not encodable ({type(e).__name__}: {e})"[:300]
        if why is not None:
            self.dropped += 1
            log.error("reply to request %r not sent, an error reply goes instead: %s", reply.get("id"), why)
            data = pack({"id": reply.get("id"), "ok": False, "gen": self.gen, "error": {
                "code": K3Error.code, "message": f"internal error in k3d: the reply could not be sent ({why})"}})
        try:
            # ROUTER: the routing frame is queued with the body or not at all (atomic multipart)
            _send(self.sock, routing, _MORE_NOBLOCK)
            _send(self.sock, data, _NOBLOCK)
        except zmq.ZMQError as e:
            if e.errno == errno.EHOSTUNREACH:     # the peer is gone (ROUTER_MANDATORY): nobody waits
                log.debug("dropping a reply to a peer that is gone")
                return
            self.dropped += 1                     # the send high-water mark: the peer is not reading
            if routing not in self._full:
                if len(self._full) > 1024:        # peers that left while flooding: forget them
                    self._full.clear()
                self._full.add(routing)
                log.warning("dropping replies to a client whose queue is full (it is not reading its "
                            "replies; %d dropped in all so far): %s", self.dropped, e)
            return
        if self._full:
            self._full.discard(routing)
