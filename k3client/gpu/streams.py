"""Expert copies on a side stream per device, overlapping the compute of the experts before.

A fetched group's views are copied host-to-device at once on the device's copy stream
(``non_blocking``: asynchronous from the registered arena; from pageable memory torch
stages them, still correct), one event recorded per expert.  Iterating the staged
group makes the compute stream wait on that expert's event, then ``record_stream``
marks the device buffers as used by the compute stream, so the caching allocator does
not hand them out again before that compute ran.  While the compute stream runs
group g's experts, the copies of group g+1 (fetched meanwhile by the host) run beside
it.

Caller's obligations: the host views stay valid until the copies complete; the
runtime's pin rule gives that, since every device is synchronised before the epoch
that pinned the views ends (``k3client.hf.gpu.GpuSide.sync``).  Owner: the model's
thread.
"""

from __future__ import annotations

import torch


class Copier:
    """A copy stream per device (created on first use)."""

    def __init__(self):
        self._streams: dict = {}

    def stream(self, device: torch.device):
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device)
        return s

    def stage(self, group, device: torch.device):
        """Issue the copies of ``group`` (``[(expert, views)]``, views a dict or tuple of host
        tensors) now; returns an iterator of ``(expert, device views)`` (see the module docstring)."""
        copy = self.stream(device)
        compute = torch.cuda.current_stream(device)
        staged = []
        with torch.cuda.stream(copy):
            for e, views in group:
                dv = to_device(views, device)
                ev = torch.cuda.Event()
                ev.record(copy)
                staged.append((e, dv, ev))
        return _in_order(staged, compute)


def _in_order(staged, compute):
    for e, dv, ev in staged:
        compute.wait_event(ev)
        for t in (dv.values() if isinstance(dv, dict) else dv):
            t.record_stream(compute)
        yield e, dv


def to_device(views, device):
    """The views (a dict or a tuple of tensors) copied to ``device``, non-blocking."""
    if isinstance(views, dict):
        return {k: v.to(device, non_blocking=True) for k, v in views.items()}
    return tuple(v.to(device, non_blocking=True) for v in views)
