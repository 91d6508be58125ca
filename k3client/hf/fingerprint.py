"""Is the daemon serving the checkpoint this process loads?  A fingerprint of both sides.

Local side: the routed-expert tensors of the checkpoint at ``path`` (names, dtypes,
shapes from the safetensors headers only: no tensor byte is read), grouped per
layer into the per-expert layout the daemon would serve:

- per-expert tensors (``...experts.{E}.{name}``): ``name``, its shape;
- stacked tensors (expert index outermost, ``[E, ...]``): the tensor, shape ``[1:]``;
  the daemon names it by what follows the experts prefix, so a daemon name matches
  a stacked key that ends with ``.{name}``.

Daemon side: the client's ``layout_of(layer)`` (what ``hello`` said), the layers and the
expert count it serves.  ``check`` compares layers, experts, names, dtypes and
shapes and raises ``Mismatch`` (``k3client.errors``) with one line naming both
sides.  Two checkpoints of one architecture with equal shapes (a fine-tune) pass
here; the loaders call ``Client.verify`` first, which compares sampled bytes too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import Mismatch

__all__ = ["Mismatch", "LocalLayer", "check", "local_layers"]

PER_EXPERT = re.compile(r"\.experts\.(\d+)\.(.+)$")


@dataclass
class LocalLayer:
    per_expert: dict[str, tuple[str, tuple]] = field(default_factory=dict)   # name -> (dtype, shape)
    stacked: dict[str, tuple[str, tuple, int]] = field(default_factory=dict)  # key -> (dtype, shape[1:], shape[0])
    experts: set[int] = field(default_factory=set)


def local_layers(keys_by_layer: dict[int, list[tuple[str, str, tuple]]]) -> dict[int, LocalLayer]:
    """``{layer: [(checkpoint key, dtype, shape), ...]}`` -> what the daemon should serve per layer."""
    out = {}
    for layer, keys in keys_by_layer.items():
        ll = LocalLayer()
        for key, dtype, shape in keys:
            m = PER_EXPERT.search(key)
            if m:
                ll.experts.add(int(m.group(1)))
                ll.per_expert.setdefault(m.group(2), (dtype, tuple(shape)))
            else:
                ll.stacked[key] = (dtype, tuple(shape[1:]), int(shape[0]) if shape else 0)
        out[layer] = ll
    return out


def _served_layers(model: dict) -> tuple[list[int] | None, list[int], int | None]:
    """(every layer served, if the daemon lists them; else None), [first, last], experts per layer."""
    layers = list(model.get("layers") or [])
    experts = model.get("experts") or []
    listed = "experts_per_layer" in model          # daemons that recognise families list every layer
    per_layer = model.get("experts_per_layer") or ((experts[-1] - experts[0] + 1) if experts else None)
    return (layers if listed else None), layers[:1] + layers[-1:], per_layer


def _fmt(specs) -> str:
    return ", ".join(f"{n} {d} {list(s)}" for n, d, s in specs)


def check(client, path: str, local: dict[int, LocalLayer], num_experts: int) -> None:
    """Raise Mismatch unless the daemon serves exactly these layers, experts and layouts."""
    model = client.model or {}
    where = f"the k3d daemon at {client.endpoint} serves {model.get('path', '?')}"
    fix = f"start one with `k3d start --source {path}` and pass its endpoint"
    full, span, n_served = _served_layers(model)
    layers = sorted(local)
    if full is not None:
        if sorted(full) != layers:
            raise Mismatch(f"{where} (expert layers {sorted(full)}), not {path} (expert layers {layers}); {fix}")
    elif layers and span and (span[0] != layers[0] or span[-1] != layers[-1]):
        raise Mismatch(f"{where} (expert layers {span[0]}-{span[-1]}), not {path} "
                       f"(expert layers {layers[0]}-{layers[-1]}); {fix}")
    count = model.get("count")
    if n_served is not None and (n_served != num_experts or (count is not None and count != len(layers) * num_experts)):
        raise Mismatch(f"{where} ({count} experts, {n_served} per layer), not {path} "
                       f"({len(layers) * num_experts} experts, {num_experts} per layer); {fix}")
    for layer in layers:
        ll = local[layer]
        served = sorted((s.name, s.dtype, tuple(s.shape)) for s in client.layout_of(layer))
        mine = _match(ll, served, num_experts)
        if mine != served:
            raise Mismatch(f"{where} with layer {layer} experts [{_fmt(served)}], not {path} "
                           f"(layer {layer}: [{_fmt(mine)}]); {fix}")


def _match(ll: LocalLayer, served: list, num_experts: int) -> list:
    """The local layout of one layer, spelled with the daemon's names where a stacked key matches."""
    mine = [(n, d, s) for n, (d, s) in ll.per_expert.items()]
    if ll.per_expert and len(ll.experts) != num_experts:
        mine.append(("<experts present>", str(len(ll.experts)), (num_experts,)))
    for key, (d, s, n0) in ll.stacked.items():
        names = [n for n, _, _ in served if key == n or key.endswith("." + n)]
        name = max(names, key=len) if names else key
        if n0 != num_experts:
            s = (n0, *s)
        mine.append((name, d, s))
    return sorted(mine)
