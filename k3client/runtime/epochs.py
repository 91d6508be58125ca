"""Epochs and grouped fetches: the pin rule a runtime keeps with the daemon.

Owner: the thread that runs the model's forward (a ``k3client.Client`` is
single-threaded).  One runtime per loaded model.

The pin rule (the daemon's: everything a client touches in an epoch stays pinned
until its next ``begin_token``, or until it releases that layer):

- every forward (a transformers forward, a vLLM step) is one epoch.  It begins right
  after the last MoE layer of the forward before (``_begin_next``, from
  ``Runtime._layer_done``): no view of that epoch is read again (CPU: the compute
  ran; GPU: its devices are synchronised first), so ``begin_token`` is sent then
  without waiting, and its reply comes back while the model runs its head, samples,
  and starts the next forward; the next forward's first fetch reads it
  (``Client.settle``), so no view is answered before the daemon began the epoch.
  The adapter's pre-hook (``begin_forward``) begins the epoch instead where the
  forward before did not (the first one, or one that stopped before its last MoE
  layer);
- a layer fetches the experts its tokens were routed to, in ascending order, as few
  groups as the arena allows (``_groups``); the views of a group are read only
  between its fetch and the next ``begin_token``, and a group is used up before the
  next group's fetch (one stream at a time);
- on a CPU a group can be fetched with ``Client.fetch_iter`` (``as_ready``): an
  iterator of the group's experts in arrival order (the resident ones first, the
  others as the daemon's reads finish), so compute overlaps reads; the compute then
  sums in a fixed order itself (``compute``).  Otherwise (a GPU) a group comes whole;
- a layer's pins end with its compute (``release_layer``, from
  ``Runtime._layer_done``, the one call at the end of every ``run_layer``): once no
  view of the layer is read again (CPU: its compute ran; GPU: its devices are
  synchronised first), the runtime releases the layer (``Client.release_layer``;
  the next message tells the daemon) and ``held`` drops by what the layer fetched
  in this epoch, so a step holds about one layer's union plus its predictions and
  needs fewer mid-forward epochs.  ``K3D_RELEASE_LAYERS=0`` keeps every layer
  pinned until the epoch ends (the comparison in ``bench/layer_pins.py``).  The
  last MoE layer begins the next epoch instead;
- when the next group would not fit beside what this epoch still pins
  (``held``), the compute of every earlier group is complete (CPU: it ran; GPU: its
  devices are synchronised first), so a new epoch starts and the group goes on.  A
  ``CacheFull``/``QuotaExceeded`` reply (other clients' pins, a quota) does the
  same, then halves the group, then waits for others' epochs to end.  So any arena
  works, down to one slot; none raises ``CacheFull`` to the caller.

The cost: a mid-forward epoch is one more round trip (plus a stream sync on a GPU),
the earlier layers' experts become evictable within the forward, and the
predictions sent before it are judged (unused ones demoted) at that epoch's end.

``stats`` (``Stats``; ``StepStats`` for the fused numerics) are local counters, read
by ``k3client.vllm.stats`` and ``model.k3d.stats.as_dict()``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from .. import errors
from .gpu import GpuSide
from .views import views

WAIT_STEP_S = 0.002


class StaleSlots(Exception):
    """A fetch's reply named slots of a daemon that restarted before its views were made."""


@dataclass
class Stats:
    forwards: int = 0
    epochs: int = 0                 # begin_token calls (forwards + mid-forward ones)
    layers_released: int = 0        # release_layer calls (a layer's pins ended with its compute)
    held_max: int = 0               # the most experts one epoch held at once (client side count)
    fetches: int = 0                # fetch messages
    experts_fetched: int = 0
    cache_full_retries: int = 0
    predicted: int = 0              # keys sent as predicted=
    predicted_used: int = 0         # ... that the next MoE layer then fetched
    fetch_seconds: dict = field(default_factory=dict)   # layer -> total seconds in fetch
    fetch_calls: dict = field(default_factory=dict)     # layer -> fetch messages

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["precision"] = (self.predicted_used / self.predicted) if self.predicted else None
        return d


@dataclass
class StepStats(Stats):
    """``Stats`` plus, per MoE layer and step, the experts fetched (the union) against tokens x top-k,
    and how many experts the native kernel computed."""

    layer_steps: int = 0
    union: int = 0          # distinct experts a layer's tokens were routed to, summed over layer-steps
    routed: int = 0         # tokens x top-k, summed over layer-steps
    native_kernel: bool = False     # a native kernel was given to the runtime (and it built)
    native_experts: int = 0         # experts computed by it
    native_calls: int = 0           # of those, calls that computed a group of experts at once (native_layer)

    def as_dict(self) -> dict:
        d = super().as_dict()
        n = self.layer_steps
        d["experts_per_layer_step"] = self.union / n if n else None
        d["routed_per_layer_step"] = self.routed / n if n else None
        return d


class Epochs:
    """The epoch and fetch side of a runtime (module docstring); ``Runtime`` adds the layer call."""

    def __init__(self, client, stats: Stats):
        self.client = client
        self.gpu = GpuSide(client)             # idle until the model runs on a CUDA device
        self.stats = stats
        self.held = 0                          # slots this epoch pins (client side count)
        self._layer_held: dict[int, int] = {}  # layer -> of ``held``, what it fetched this epoch and holds
        self.release = os.environ.get("K3D_RELEASE_LAYERS", "1") not in ("0", "off", "false", "no")
        self._restarts = client.restarts
        self._gen = None
        self._early = False                    # the next forward's epoch was begun by the last MoE layer

    # -- epochs ----------------------------------------------------------------
    def begin_forward(self) -> None:
        """One epoch per forward: begun here, unless the last forward's last MoE layer began it."""
        self.stats.forwards += 1
        if self._early:
            self._early = False
            self.stats.epochs += 1
        else:
            self._new_epoch()

    def _begin_next(self) -> None:
        """The next forward's epoch, begun after this forward's last MoE layer (module docstring);
        no pin is held between forwards."""
        self._sync_device()
        self.client.begin_token(wait=False)
        self.held = 0
        self._layer_held.clear()
        self._restarts = self.client.restarts
        self._early = True

    def _new_epoch(self) -> None:
        self._sync_device()
        # not waited for: its reply is read before the next fetch (_check_restart), so the
        # daemon's work overlaps the client's own
        self.client.begin_token(wait=False)
        self.stats.epochs += 1
        self.held = 0
        self._layer_held.clear()
        self._restarts = self.client.restarts

    def release_layer(self, layer: int) -> None:
        """``layer``'s compute is complete: release its pins of this epoch (module docstring)."""
        n = self._layer_held.get(layer, 0)
        if not n or not self.release:
            return
        self._layer_held[layer] = 0         # (kept: this epoch has fetched, see _groups)
        self._sync_device()
        self.client.release_layer(layer)
        self.held -= n
        self.stats.layers_released += 1

    def _sync_device(self) -> None:
        """The pin rule on a GPU: no queued copy may outlive the epoch that pinned its slot
        (every device with work queued: ``GpuSide.sync``)."""
        self.gpu.sync()

    def _check_restart(self) -> None:
        self.client.settle()                         # a restart it finds is seen just below
        if self.client.restarts != self._restarts:   # a new daemon: no pins held there
            self._restarts = self.client.restarts
            self.held = 0
            self._layer_held.clear()
        if self._gen != self.client.gen:
            self.gpu.follow(self.client)             # a new arena: registered where the model is on CUDA
            self._gen = self.client.gen

    # -- grouped fetches -----------------------------------------------------------
    def _groups(self, ml, experts: list[int], predicted, as_ready: bool = False):
        """Yield groups of ``(expert, views)``; the caller computes (uses up) each before
        the next.  ``as_ready``: a group is an iterator in the order the experts arrive."""
        i, cap, waited = 0, max(1, self.client.slots), 0.0
        while i < len(experts):
            self._check_restart()
            cap = min(cap, max(1, self.client.slots))
            left = len(experts) - i
            if self.held and self.held + min(left, cap) > cap:
                self._new_epoch()
            n = min(left, max(1, cap - self.held))
            group = experts[i:i + n]
            try:
                got = self._fetch(ml, group, predicted, as_ready)
            except (errors.CacheFull, errors.QuotaExceeded) as e:
                self.stats.cache_full_retries += 1
                if self.held or self._layer_held:
                    # (a released layer counts too: this epoch's predictions may still pin
                    # slots, and only a new epoch ends them)
                    self._new_epoch()
                elif n > 1:
                    cap = max(1, n // 2)
                else:
                    if waited > self.client.timeout:
                        raise type(e)(f"{e} (waited {waited:.0f}s for other clients' pins)") from None
                    time.sleep(WAIT_STEP_S)
                    waited += WAIT_STEP_S
                continue
            except StaleSlots:
                continue                      # slots named by a daemon that is gone: fetch again
            predicted = None                  # sent once, with the layer's first fetch
            self.held += n
            self._layer_held[ml.layer] = self._layer_held.get(ml.layer, 0) + n
            self.stats.held_max = max(self.stats.held_max, self.held)
            i += n
            yield got

    def _fetch(self, ml, group: list[int], predicted, as_ready: bool = False):
        """The group's ``(expert, views)``: a list in ``group``'s order, or with ``as_ready``
        an iterator in arrival order whose first expert is here already (a refusal such
        as ``CacheFull`` comes with the first reply, so it is raised here, retried by
        ``_groups``).  ``stats.fetch_seconds`` counts the time spent waiting for them."""
        t0 = time.perf_counter()
        if as_ready:
            stream = self.client.fetch_iter(ml.layer, group, predicted=predicted)
            first = next(stream)[1]
        else:
            fetched = self.client.fetch(ml.layer, group, predicted=predicted)
        # views now: a restart after this leaves them on the old mapping, still correct
        try:
            got = [(first.expert, self._views(ml, first))] if as_ready else \
                [(ex.expert, self._views(ml, ex)) for ex in fetched]
        except errors.DaemonRestarted:       # re-attached between the reply and the views
            raise StaleSlots() from None
        st = self.stats
        st.fetches += 1
        st.experts_fetched += len(group)
        self._waited(ml.layer, time.perf_counter() - t0)
        st.fetch_calls[ml.layer] = st.fetch_calls.get(ml.layer, 0) + 1
        if predicted:
            st.predicted += len(predicted)
        return self._arrivals(ml, got[0], stream) if as_ready else got

    def _arrivals(self, ml, first, stream):
        """``first``, then the stream's experts as they arrive, each with its views."""
        yield first
        while True:
            t0 = time.perf_counter()
            ex = next(stream, None)
            self._waited(ml.layer, time.perf_counter() - t0)
            if ex is None:
                return
            yield ex[1].expert, self._views(ml, ex[1])

    def _waited(self, layer: int, dt: float) -> None:
        self.stats.fetch_seconds[layer] = self.stats.fetch_seconds.get(layer, 0.0) + dt

    def _views(self, ml, ex):
        """The one views rule (``views.views``); a method so a test can watch the arrival order."""
        return views(ml, ex)
