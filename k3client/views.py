"""Zero-copy views of one fetched expert in the shared arena.

Memory layout: slot ``s`` of the arena starts at ``s * slot_bytes``; a tensor of
the expert's layer layout lies at ``spec.offset`` inside it, ``spec.nbytes`` long
(``k3client.layout``).  The mapping is PROT_READ over a sealed memfd, so every
view is read-only.

Views are cached per client by (slot, layer layout, tensor): a view is a window
on the mapping, valid for whatever key the slot holds now, so a slot seen before
costs a dict lookup, not a new mapping.  The cache goes with the mapping: it is
the attachment's (``attachment.py``; a re-attach clears it).  An ``Expert`` reads
the mapping, layouts and cache from its client's attachment (``_at``) and holds
its client too: while an ``Expert`` lives, its client does, and so does its lease.

Thread: an ``Expert`` belongs to its ``Client``'s thread.  Caller's obligation: a
view is valid until the client's next ``begin_token()`` (the daemon keeps the
slot pinned until then), ``close()``, or ``release_layer()`` of its layer.  What
the client enforces: an ``Expert`` builds no view once its pin has ended.  Each
fetch call takes the next number of the client's fetch count (``Client._seq``);
an ``Expert`` keeps its fetch's number (``seq``) and refuses (``Expired``) when
that number is at most the count at the client's last ``begin_token()`` or
``close()`` (``Client._expired``) or at its last release of the expert's layer
(``Client._released``).  A view built earlier cannot be taken back (it is memory),
but one asked for after the pin ended is refused instead of showing whatever the
slot holds by then.  An ``Expert`` bound to an older daemon generation raises
``DaemonRestarted`` instead of building a view.
"""

from __future__ import annotations

import warnings

import numpy as np

from . import errors
from .layout import DTYPES, TensorSpec, layout_bytes, numpy_dtype

# torch warns that a read-only buffer is not writable: that is the point here.  One
# filter for the process, installed with the first tensor view: catch_warnings per
# view would be process-global state changed per tensor, and not thread-safe.
_TORCH_FILTER = []


class Expert:
    """One fetched expert: ``layer``, ``expert``, ``slot``; views into the arena."""

    __slots__ = ("layer", "expert", "slot", "gen", "seq", "_client", "_at")

    def __init__(self, client, layer: int, expert: int, slot: int):
        self.layer, self.expert, self.slot, self._client = layer, expert, slot, client
        self._at = at = client._at
        self.gen, self.seq = at.gen, client._seq

    def _mapping(self):
        """The arena this expert's slot number refers to, or DaemonRestarted / Expired."""
        at = self._at
        if self.gen != at.gen or at.mm is None:
            raise errors.DaemonRestarted(
                f"expert (layer {self.layer}, expert {self.expert}) was fetched from a daemon that has "
                "since restarted (or this client is closed); its slot means nothing now: fetch it again")
        c = self._client
        if self.seq <= c._expired or self.seq <= c._released.get(self.layer, 0):
            why = "begin_token()" if self.seq <= c._expired else f"release_layer({self.layer})"
            raise errors.Expired(
                f"expert (layer {self.layer}, expert {self.expert}) was fetched before this client's "
                f"{why}: its pin has ended and its slot may hold another expert now; fetch it again")
        return at.mm

    def __repr__(self):
        return f"Expert(layer={self.layer}, expert={self.expert}, slot={self.slot})"

    def _spec(self, name: str) -> TensorSpec:
        specs = self._at.specs_of(self.layer)
        try:
            return specs[name]
        except KeyError:
            raise KeyError(f"no tensor {name!r} in layer {self.layer}'s layout; have {sorted(specs)}") from None

    def memory(self) -> memoryview:
        """Read-only view of the whole expert span in its slot (its layer's layout)."""
        mm = self._mapping()
        c = self._at
        base = self.slot * c.slot_bytes
        return memoryview(mm)[base:base + layout_bytes(c.layout_of(self.layer))]

    def _key(self, name: str):
        return (self.slot, self.layer if self._at.layouts else -1, name)

    def array(self, name: str) -> np.ndarray:
        """Read-only numpy view of one tensor, no copy.

        numpy has no bfloat16 or fp8: those types come back as the unsigned
        integer of the same width (BF16 -> ``uint16``, F8_* -> ``uint8``) holding the raw
        bits; ``tensor()`` gives the real dtype, or ``arr.view(ml_dtypes.bfloat16)``."""
        mm = self._mapping()
        views, key = self._at.views, ("np", *self._key(name))
        v = views.get(key)
        if v is None:
            spec = self._spec(name)
            dt = numpy_dtype(spec.dtype)
            off = self.slot * self._at.slot_bytes + spec.offset
            v = views[key] = np.frombuffer(mm, dtype=dt, count=spec.nbytes // dt.itemsize,
                                           offset=off).reshape(spec.shape)
        return v

    def tensor(self, name: str):
        """torch view of one tensor, no copy, in its real dtype (needs torch). Do not write to it."""
        try:
            import torch  # optional: k3client itself needs only numpy, pyzmq and msgpack
        except ImportError:
            raise ImportError("Expert.tensor() needs torch: pip install torch --index-url "
                              "https://download.pytorch.org/whl/cpu (CPU build; or your CUDA build); "
                              "Expert.array() works without it") from None

        mm = self._mapping()
        views, key = self._at.views, ("torch", *self._key(name))
        v = views.get(key)
        if v is None:
            if not _TORCH_FILTER:
                warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
                _TORCH_FILTER.append(True)
            spec = self._spec(name)
            tdt = getattr(torch, DTYPES[spec.dtype][2])
            off = self.slot * self._at.slot_bytes + spec.offset
            v = views[key] = torch.frombuffer(mm, dtype=tdt, count=spec.nbytes // DTYPES[spec.dtype][0],
                                              offset=off).view(spec.shape)
        return v

    def stacked(self, names: tuple[str, ...]):
        """One torch view of tensors that lie back to back in the slot (same dtype, same
        trailing shape), concatenated along dim 0; None when they do not.  No copy; cached
        like ``tensor``.  Do not write to it."""
        self._mapping()                            # first: a cached view may be of a later attachment's slot
        key = ("torch-stacked", *self._key("\0".join(names)))
        views = self._at.views
        v = views.get(key)
        if v is False:                             # not back to back: known from this layout
            return None
        if v is None:
            first = self.tensor(names[0])          # the torch filter, the mapping check
            specs = [self._spec(n) for n in names]
            s0 = specs[0]
            for a, b in zip(specs, specs[1:]):
                if b.dtype != s0.dtype or tuple(b.shape[1:]) != tuple(s0.shape[1:]) or b.offset != a.offset + a.nbytes:
                    views[key] = False
                    return None
            import torch

            rows = sum(s.shape[0] for s in specs)
            off = self.slot * self._at.slot_bytes + s0.offset
            v = views[key] = torch.frombuffer(self._mapping(), dtype=first.dtype,
                                              count=sum(s.nbytes for s in specs) // first.element_size(),
                                              offset=off).view(rows, *s0.shape[1:])
        return v
