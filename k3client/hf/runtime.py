"""One loaded model's link to the daemon: epochs, grouped fetches, gate-ahead predictions.

Owner: the thread that runs the model's forward (a ``k3client.Client`` is
single-threaded).  One ``Runtime`` per ``load_model``.

The pin rule this keeps (the daemon's: everything a client touches in an epoch
stays pinned until its next ``begin_token``, or until it releases that layer):

- every forward is one epoch.  It begins right after the last MoE layer of the
  forward before (``_begin_next``): no view of that epoch is read again (CPU: the
  compute ran; GPU: its devices are synchronised first), so ``begin_token`` is sent
  then without waiting, and its reply comes back while the model runs its head,
  samples, and starts the next forward; the next forward's first fetch reads it
  (``Client.settle``), so no view is answered before the daemon began the epoch.
  A pre-hook on the decoder begins the epoch instead where the forward before did
  not (the first one, or one that stopped before its last MoE layer);
- a layer fetches the experts its tokens were routed to, in ascending order (the
  eager loop's order), as few groups as the arena allows; the views of a group
  are read only between its fetch and the next ``begin_token``;
- on a CPU a group is fetched with ``Client.fetch_iter``: each expert is computed
  as it arrives (the resident ones first, the others as the daemon's reads
  finish), overlapping compute with reads, and the outputs are added to the
  layer's output in ascending expert order (``_InOrder``), eager's summation
  order, so the logits stay bit-equal to eager.  A group is used up before the
  next group's fetch (one stream at a time).  On a GPU the group comes whole
  (``fetch``) and is computed in order;
- a layer's pins end with its compute (``_layer_done``, the one call at the end of
  every ``run_layer``): once no view of the layer is read again (CPU: its compute
  ran; GPU: its devices are synchronised first), the runtime releases the layer
  (``Client.release_layer``; the next message tells the daemon) and ``held`` drops by
  what the layer fetched in this epoch, so a step holds about one layer's union
  plus its predictions and needs fewer mid-forward epochs.  ``K3D_RELEASE_LAYERS=0``
  keeps every layer pinned until the epoch ends (the comparison in
  ``bench/layer_pins.py``).  The last MoE layer begins the next epoch instead;
- when the next group would not fit beside what this epoch still pins
  (``held``), the compute of every earlier group is complete (CPU: it ran; GPU:
  its devices are synchronised first), so a new epoch starts and the group goes on.
  A ``CacheFull``/``QuotaExceeded`` reply (other clients' pins, a quota) does
  the same, then halves the group, then waits for others' epochs to end.  So
  any arena works, down to one slot; none raises ``CacheFull`` to the caller.

The cost: a mid-forward epoch is one more round trip (plus a stream sync on a
GPU), the earlier layers' experts become evictable within the forward, and the
predictions sent before it are judged (unused ones demoted) at that epoch's end.

Gate-ahead: in layer L, the next MoE layer's own router is applied to layer L's
hidden states; the experts it picks are sent as ``predicted=`` with layer L's
first fetch (one message).  Local counters (``stats``) say how many of those the
next layer then fetched (precision as this process sees it).
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field

import torch

from .. import errors
from . import families, gpu

WAIT_STEP_S = 0.002


class _StaleSlots(Exception):
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
class MoeLayer:
    layer: int
    module: object                  # the experts module
    router: object | None           # its block's router (for gate-ahead of the layer before)
    family: object                  # families.Standard / GptOss
    names: tuple                    # layout names, for the views
    dtype: torch.dtype              # the dtype eager would hold the weights in
    next: int | None = None         # next MoE layer


class Runtime:
    """Fetches experts for the forward in progress; see the module docstring."""

    def __init__(self, client, layers: dict[int, MoeLayer], predict: bool = True):
        self.client = client
        self.layers = layers
        self.predict = predict
        self.gpu = gpu.GpuSide(client)         # idle until the model runs on a CUDA device
        self.stats = Stats()
        self.held = 0                          # slots this epoch pins (client side count)
        self._layer_held: dict[int, int] = {}  # layer -> of ``held``, what it fetched this epoch and holds
        self.release = os.environ.get("K3D_RELEASE_LAYERS", "1") not in ("0", "off", "false", "no")
        self._restarts = client.restarts
        self._gen = None
        self._pending_prediction: tuple[int, set[int]] | None = None
        self._early = False                    # the next forward's epoch was begun by the last MoE layer
        order = sorted(layers)
        for a, b in itertools.pairwise(order):
            layers[a].next = b

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
        self._layer_held.clear()            # (empty: nothing fetched in this epoch yet)
        self._restarts = self.client.restarts
        self._early = True

    def _new_epoch(self) -> None:
        self._sync_device()
        # not waited for: its reply is read before the next fetch (_check_restart), so the
        # daemon's work overlaps the client's own
        self.client.begin_token(wait=False)
        self.stats.epochs += 1
        self.held = 0
        self._layer_held.clear()            # (empty: nothing fetched in this epoch yet)
        self._restarts = self.client.restarts

    def _layer_done(self, ml: MoeLayer) -> None:
        """``ml``'s compute is complete (CPU: it ran; GPU: synchronised here): the last MoE
        layer begins the next forward's epoch; another releases its pins of this epoch."""
        if ml.next is None:
            self._begin_next()
            return
        n = self._layer_held.get(ml.layer, 0)
        if not n or not self.release:
            return
        self._layer_held[ml.layer] = 0      # (kept: this epoch has fetched, see _groups)
        self._sync_device()
        self.client.release_layer(ml.layer)
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
            self._layer_held.clear()            # (empty: nothing fetched in this epoch yet)
        if self._gen != self.client.gen:
            self.gpu.follow(self.client)             # a new arena: registered where the model is on CUDA
            self._gen = self.client.gen

    # -- the experts call --------------------------------------------------------
    def run_layer(self, ml: MoeLayer, hidden_states, top_k_index, top_k_weights):
        """The eager loop of ``ml``'s family over arena views, in groups that fit."""
        if hidden_states.device.type == "cuda":
            return self.gpu.run_layer(self, ml, hidden_states, top_k_index, top_k_weights)
        module = ml.module
        num_experts = module.num_experts
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=num_experts + 1)
            expert_mask = expert_mask.permute(2, 1, 0)
            hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        experts = [e for e in hit[:, 0].tolist() if e < num_experts]
        self._score_prediction(ml.layer, experts)
        predicted = self._predict_next(ml, hidden_states) if self.predict else None
        device = hidden_states.device
        as_ready = device.type != "cuda"
        acc = _InOrder(out, experts) if as_ready else None
        for group in self._groups(ml, experts, predicted, as_ready):
            for e, views in group:
                w = ml.family.weights(module, views, device, ml.dtype)
                top_k_pos, token_idx = torch.where(expert_mask[e])
                if acc is not None:
                    acc.add(e, token_idx, ml.family.output(module, w, hidden_states[token_idx], token_idx,
                                                           top_k_pos, top_k_weights))
                    continue
                ml.family.compute(module, w, hidden_states[token_idx], token_idx, top_k_pos, top_k_weights, out)
        self._layer_done(ml)
        return out

    def _groups(self, ml: MoeLayer, experts: list[int], predicted, as_ready: bool = False):
        """Yield groups of ``(expert, {name: view})``; the caller computes (uses up) each before
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
            except _StaleSlots:
                continue                      # slots named by a daemon that is gone: fetch again
            predicted = None                  # sent once, with the layer's first fetch
            self.held += n
            self._layer_held[ml.layer] = self._layer_held.get(ml.layer, 0) + n
            self.stats.held_max = max(self.stats.held_max, self.held)
            i += n
            yield got

    def _fetch(self, ml: MoeLayer, group: list[int], predicted, as_ready: bool = False):
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
            raise _StaleSlots() from None
        st = self.stats
        st.fetches += 1
        st.experts_fetched += len(group)
        self._waited(ml.layer, time.perf_counter() - t0)
        st.fetch_calls[ml.layer] = st.fetch_calls.get(ml.layer, 0) + 1
        if predicted:
            st.predicted += len(predicted)
        return self._arrivals(ml, got[0], stream) if as_ready else got

    def _arrivals(self, ml: MoeLayer, first, stream):
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

    def _views(self, ml: MoeLayer, ex) -> dict:
        """``{name: zero-copy view}`` of one fetched expert, what ``family.weights`` reads; a
        split gate/up lying back to back in the slot comes as one view (``families.STACKED``)."""
        f = ml.family
        if getattr(f, "gate", None) is not None:
            both = ex.stacked((f.gate, f.up))      # cached per slot, like every view
            if both is not None:
                return {families.STACKED: both, f.down: ex.tensor(f.down)}
        return {n: ex.tensor(n) for n in ml.names}

    # -- gate-ahead ---------------------------------------------------------------
    def _predict_next(self, ml: MoeLayer, hidden_states):
        nxt = self.layers.get(ml.next) if ml.next is not None else None
        if nxt is None or nxt.router is None:
            self._pending_prediction = None
            return None
        with torch.no_grad():
            routed = nxt.router(hidden_states)
        idx = _expert_indices(routed)
        if idx is None:
            self._pending_prediction = None
            return None
        experts = sorted(set(idx.reshape(-1).tolist()))
        self._pending_prediction = (nxt.layer, set(experts))
        return [(nxt.layer, e) for e in experts]

    def _score_prediction(self, layer: int, experts: list[int]) -> None:
        p = self._pending_prediction
        if p is not None and p[0] == layer:
            self.stats.predicted_used += len(p[1] & set(experts))
            self._pending_prediction = None


class _InOrder:
    """Expert outputs computed in any order, added to ``out`` in the order of ``experts``
    (eager's ascending loop): each ``index_add_`` happens as soon as every expert before it
    has been added, so the summation order, hence every bit, is eager's; an output waits
    here only while an expert before it is still being read."""

    def __init__(self, out, experts: list[int]):
        self.out, self.order, self.next, self.held = out, experts, 0, {}

    def add(self, expert: int, token_idx, h) -> None:
        self.held[expert] = (token_idx, h)
        order, held = self.order, self.held
        while self.next < len(order) and order[self.next] in held:
            idx, h = held.pop(order[self.next])
            self.out.index_add_(0, idx, h.to(self.out.dtype))
            self.next += 1


def _expert_indices(routed):
    """The expert indices among a router's outputs: its one integer tensor.  Families order
    their router's tuple differently (``(logits, scores, indices)``, ``(indices, weights,
    logits)``) and transformers releases have changed a family's order; None if none is."""
    if isinstance(routed, torch.Tensor):
        return routed if not routed.is_floating_point() else None
    ints = [t for t in routed if isinstance(t, torch.Tensor) and not t.is_floating_point()]
    return ints[0] if len(ints) == 1 else None
