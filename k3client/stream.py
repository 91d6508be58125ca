"""A fetch answered as its experts become ready: ``Client.fetch_iter``'s generator.

Wire (protocol 5): a ``fetch`` with ``as_ready`` is answered by parts
``{part: [index, ...], slots: [...]}`` (indices into the request's keys) and then
the ordinary final reply ``{slots: [...]}`` (every key); a fetch the daemon
answers at once sends only the final one.  Each key named is pinned under this
client's token when it is sent, so an ``Expert`` yielded from a part is as good
as one ``fetch`` returns: valid until the next ``begin_token()`` or ``close()``.

The hit path's window (``hits.py``; ``k3d/cache/reuse.py``, C1) is shut from
the send and opens only when the FINAL reply has come and every expert of it
has been handed out: a part is not the reply to the request.  Anything else
keeps it shut until a later request succeeds: a timeout, an error reply, a
KeyboardInterrupt in the caller's loop body, the caller leaving the loop
(``GeneratorExit``), a re-attach.  The experts already yielded stay valid (the
daemon pinned them); the rest of the stream is skipped by the next request's
wait (another ``id``).

The request socket is held (its attachment's ``io``) only while sending and while
waiting for one reply, never across a ``yield``: the lease thread may send its
``hits``/``seen`` between parts (the daemon ignores ``seen`` while the request
is pending, and there are no reports while the window is shut).

One stream at a time: any other request of the client (``_call``, a
``begin_token(wait=False)``, ``close``) ends the stream (``client._stream``);
resuming it then raises ``K3Error``, as its remaining parts went unread.  So does
the client's release of the stream's layer (``release_layer``): the daemon unpins
the layer when the release arrives, reads still running included, so a part sent
after that names slots nothing keeps.  The window stays shut until the next
request's reply (that request, or the lease thread before it, carries the release).

Thread: the ``Client``'s thread, like every other call of it.
"""

from __future__ import annotations

import time

from . import errors
from .channel import Gone
from .views import Expert


class _Token:
    """``client._stream`` while a stream runs: ``Client.release_layer`` of its layer ends it."""

    __slots__ = ("layer",)

    def __init__(self, layer: int):
        self.layer = layer


def stream(client, layer: int, experts: list[int], preds: list) -> object:
    """An iterator of ``(index, Expert)`` for ``experts`` of ``layer`` as the daemon sends them:
    the ready ones first, then each batch as its reads finish; each index once.

    The stream is the client's from this call, not from the first step: a call made
    before that step (``begin_token``, the release of ``layer``) ends it as it ends one
    begun, and nothing is sent for it (its ``Expert``s would carry the number of a fetch
    made before that call: ``Expired``)."""
    token = _Token(layer)
    client._stream = token
    return _steps(client, token, layer, experts, preds)


def _steps(client, token: _Token, layer: int, experts: list[int], preds: list):
    if client._stream is not token:
        raise errors.K3Error(
            f"fetch_iter: this client sent another request, or released layer {layer}, before the "
            "iteration began, so nothing was fetched; call fetch_iter again")
    left = dict.fromkeys(range(len(experts)))    # indices not yet yielded, in request order
    deadline = time.monotonic() + client.timeout     # for retries of SlotsBusy, as ``_call``
    pause = 0.0005
    attached = client._at                        # one for the client's life (attachment.py)
    while left:
        if attached.chan is None:
            client._reattach("not attached")
            client._stream = token
            continue
        hits = attached.hits
        at = list(left)                          # the indices this request asks for
        fields = {"keys": [[layer, experts[i]] for i in at], "as_ready": True}
        if preds:
            fields["predicted"] = preds
        final = False
        try:
            with attached.io:
                rid = attached.post(hits, "fetch", fields)
            while not final:
                with attached.io:
                    # each part within ``timeout`` of asking for it: the caller's compute
                    # between parts is not the daemon's delay
                    reply = attached.chan.wait(rid, "fetch", client.timeout)
                part = reply.get("part")
                final = part is None
                got = list(zip(at, reply["slots"])) if final else [(at[j], s) for j, s in zip(part, reply["slots"])]
                if attached.hits is not None:     # pinned for this client's token: its quota count
                    attached.hits.held_by_daemon([s for _, s in got], layer)
                for i, slot in got:
                    if i in left:
                        del left[i]
                        yield i, Expert(client, layer, experts[i], slot)
                        if client._stream is not token:
                            raise errors.K3Error(
                                f"fetch_iter: this client sent another request, or released layer {layer}, "
                                "before the iteration ended, so its remaining experts went unread; fetch "
                                "them again")
        except Gone as e:
            if hits is not None:
                hits.failed()
            client._reattach(str(e))
            client._stream = token
            continue
        except errors.SlotsBusy:
            if hits is not None:
                hits.failed()
            if time.monotonic() + pause > deadline:
                raise
            time.sleep(pause)
            pause = min(0.05, pause * 2)
            continue
        except BaseException:                    # Timeout, an error reply, an interrupt, GeneratorExit
            # (a stream another request ended, collected later, leaves the window to that
            # request: it is the latest one now)
            if hits is not None and client._stream is token:
                hits.failed()
            raise
        if hits is not None and hits is attached.hits and client._stream is token:
            hits.open = True
    if client._stream is token:
        client._stream = None
