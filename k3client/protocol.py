"""Wire schema between model processes and the daemon.

Transport: ZeroMQ, ROUTER in the daemon, DEALER in each client, one msgpack map
per message (a single frame after the ROUTER's identity frame).

Request::

    {"v": PROTOCOL_VERSION, "op": str, "id": int, ...op fields}

Reply (the same ``id``; ``gen`` is the daemon instance, random per start, so a
client can tell a restarted daemon from the one it attached to)::

    {"id": int, "ok": True, "gen": int, ...result fields}
    {"id": int, "ok": False, "gen": int, "error": {"code": str, "message": str}}

Ops (the ``op_*`` handler docstrings in ``k3d.serve.ops`` are the full spec):

- ``hello {name, pid, hit_path}`` -> ``{client_id, layout, slots, slot_bytes, expert_bytes,
  arena_bytes, index_bytes, arena_socket, lease_s, pin_quota, model}``; must come first.  (The key
  set is not sent: an unknown key is an ``unknown_expert`` error reply.)
- ``fetch {keys: [[layer, expert], ...], predicted: [[l, e], ...], hits, as_ready?}`` ->
  ``{slots: [int, ...]}`` in request order, sent once every key is ready.  With
  ``as_ready: true`` (version 5), a fetch that waits for reads first sends parts with
  the same ``id``: ``{part: [index, ...], slots: [int, ...]}`` (indices into ``keys``),
  the keys ready now, then each batch whose reads finished; every key named in a
  part is pinned as in the final reply, which is unchanged (all slots) and the only
  one without ``part``.  A fetch answered at once sends no part.  The client's hit
  path window opens only with the final reply.
- ``predict {keys, hits}`` -> ``{queued: int}`` at once (reads run in the background).
- ``hits {hits, seen?}`` -> no reply: reports sent without waiting (when many accumulate,
  and from the lease thread with ``seen``, the index's retirement count read after them).
- ``begin_token {hits}`` -> ``{epoch, released}`` (a ``done`` here is ignored: every pin
  of the epoch goes).
- ``heartbeat {client_id, gen}`` -> no reply (sent from the client's lease thread;
  one for another daemon generation is ignored, one from another process than the
  client's renews nothing).
- ``status {}`` -> ``{status: {...}}`` (the dict ``k3ctl status --json`` prints); no
  hello needed.
- ``bye {hits}`` -> ``{}``; releases everything the client held.

``done`` (version 6; optional on ``fetch``, ``hits``, ``predict``, ``status``): layers the
client is done with for its current token, ``[layer, ...]``.  Applied after the
message's ``hits``: the client's pins of slots whose key is of such a layer go
(other clients' misses may evict them), and so do its claims of slots it reported
under them (``k3d/cache/reuse.py``); its predictions not fetched yet stay pinned
until its next ``begin_token`` (a fetched one's pin goes with its layer).  A client
sends it (``Client.release_layer``) only once no view of those layers from this
token is read again; a later fetch of the layer pins afresh.

``hits`` (optional everywhere) are the fetches a hit-path client answered itself
from the shared index (``k3client.index``) since its last message, in order:
``[[layer, [experts], [slots seen]], ...]``.  A hit-path client sends a fetch only
when some key is not READY in the index, or with predictions of keys not
resident (a slot they evict is reused at once only while it waits), with every
key of it.  Version 4: it answers hits itself only after the reply to its latest
request (a failure, a timeout or an interrupt keeps that window shut), every
message it sends carries its reports in order on its one request socket, and a
view has no time bound (``k3d/cache/reuse.py`` states the client's obligations).

Replies carry slot numbers, never expert bytes: the bytes are read from the
shared arena, whose memfd the client receives once over ``arena_socket`` (a Unix
SOCK_SEQPACKET socket; SCM_RIGHTS).  The arena message is
``{"gen", "arena_bytes", "index_bytes", "slot_bytes", "slots"}`` with two fds
attached: the arena's and the shared index's.

Decode limits (``unpack``) bound every container so a hostile frame cannot make
the daemon allocate without bound.  A request is at most ``MAX_MESSAGE_BYTES``
(1 MiB; a fetch of ``MAX_KEYS`` keys with as many predictions and hit reports
is under 100 KiB): the daemon's ZeroMQ ends the connection of a peer that sends
a larger frame (ZMQ_MAXMSGSIZE), unanswered, so ``pack_request`` refuses to
build one (``BadRequest``).  The daemon keeps at most 32 requests of one client
waiting for their turn (``k3d.serve.wire.MAX_QUEUED``); one more is answered at
once with a one-line ``bad_request``, after its hit reports are applied (a
``hits`` report or heartbeat over the cap is applied, unanswered as ever).  This
client waits for each reply, so only its hit reports can queue behind a request,
and none is lost.

Keys are integers.  ``key_int`` / ``key_pairs`` refuse anything else before a
request is sent (``BadRequest``, one line): a float is never rounded (``1.5`` is
not expert 1), a string never parsed, and a bool is not an index.  numpy and torch
integer scalars are integers (``operator.index``).

Pure functions and constants: no state, safe from any thread.
"""

from __future__ import annotations

import operator

import msgpack

from .errors import BadRequest

PROTOCOL_VERSION = 6
MAX_MESSAGE_BYTES = 1 << 20
MAX_REPLY_BYTES = 64 * MAX_MESSAGE_BYTES    # a client's socket accepts no larger message (ZMQ_MAXMSGSIZE)
MAX_KEYS = 4096          # keys in one fetch/predict
MAX_STR = 4096
MAX_CONTAINER = 4 * MAX_KEYS


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def packer():
    """``pack`` for one thread's repeated use (the daemon's replies): the same bytes,
    without a ``Packer`` made per call (~0.35 µs of a ~0.7 µs reply)."""
    return msgpack.Packer(use_bin_type=True).pack


def pack_request(msg: dict) -> bytes:
    """``msg`` packed, if within ``MAX_MESSAGE_BYTES`` (else ``BadRequest``, one line)."""
    data = pack(msg)
    if len(data) > MAX_MESSAGE_BYTES:
        raise BadRequest(f"{msg.get('op')} request of {len(data)} bytes exceeds the daemon's "
                         f"{MAX_MESSAGE_BYTES} byte limit; send fewer keys per request")
    return data


def unpack(data: bytes):
    """Decode one message with hard limits; raises ValueError-family on junk."""
    return msgpack.unpackb(
        data,
        raw=False,
        strict_map_key=True,
        max_str_len=MAX_STR,
        max_bin_len=MAX_STR,
        max_array_len=MAX_CONTAINER,
        max_map_len=64,
        max_ext_len=0,
    )


def key_int(what: str, v) -> int:
    """``v`` as an int if it is an integer (``operator.index``: int, numpy and torch
    integer scalars), never rounding a float or parsing a string; bools are refused
    too: ``True`` would silently mean expert 1."""
    if type(v) is int:                   # the common case, first: one check per key on the hit path
        return v
    if not isinstance(v, bool) and type(v).__name__ != "bool_":
        try:
            return operator.index(v)
        except TypeError:
            pass
    raise BadRequest(f"{what} must be an integer, not {type(v).__name__} {v!r}")


def items(what: str, v) -> list:
    if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__"):
        raise BadRequest(f"{what} must be a list of integers, not {type(v).__name__} {v!r}")
    return list(v)


def key_pairs(what: str, pairs) -> list[list[int]]:
    out = []
    for p in items(what, pairs):
        p = items(f"each of {what}", p)
        if len(p) != 2:
            raise BadRequest(f"each of {what} must be a (layer, expert) pair, not {p!r}")
        out.append([key_int("layer", p[0]), key_int("expert", p[1])])
    return out
