"""``k3d inspect SRC [--json]``: what a checkpoint would serve, without starting the daemon.

Opens the source exactly as ``k3d start`` does (``open_source``: the same family
rules, the same checks; remote URLs fetch only headers and config.json), reads no
expert bytes, and reports:

- the family and the rule that matched it (config.json's model_type, the tensor
  names, ``--pattern``, or the GGUF architecture);
- the layers with experts, experts per layer, bytes per expert (per layer where
  layouts differ), the layout(s), ``tensor_format`` and the total expert bytes;
- sizing: the slots one client pins per token (layers x top-k: every MoE layer of
  a token keeps its top-k experts pinned until the next ``begin_token``), the
  arena that many pins need for 1, 4 and 16 clients decoding at once, and the
  arena that holds the whole model.  Slots are 4096-aligned and sized to the
  largest expert, as the daemon sizes them.

When no expert tensor is found the source's error already carries the hint (the
first tensor names seen and a suggested ``--pattern``); it is printed as the
one-line error ``k3d start`` prints, exit 1.

Runs on the caller's thread; pure apart from opening (and closing) the source.
"""

from __future__ import annotations

import json
import sys

from k3client.layout import align, layout_bytes
from k3d.sizes import show_size
from k3d.sources import SourceError, open_source
from k3d.sources.base import PAGE, span_text

CLIENTS = (1, 4, 16)


def report(src) -> dict:
    """The inspection of an open source, as the JSON output gives it."""
    d = src.describe()
    layers = d["layers"]
    slot = align(max(src.expert_bytes, 1), PAGE)
    per_layer_bytes = {layer: layout_bytes(src.layout_of(layer)) for layer in layers}
    counts: dict[int, int] = {}
    for layer, _ in src.keys:
        counts[layer] = counts.get(layer, 0) + 1
    total = sum(per_layer_bytes[layer] * counts[layer] for layer in layers)
    groups = src.layout_groups()
    top_k = d.get("top_k")
    pins = len(layers) * (top_k or 1)
    out = {
        "source": {"kind": d["kind"], "path": d["path"]},
        "family": d.get("family"), "rule": d.get("family_rule"),
        "layers": layers, "experts_per_layer": d["experts_per_layer"], "experts": len(src.keys),
        "top_k": top_k, "tensor_format": d["tensor_format"],
        "expert_bytes": src.expert_bytes if len(set(per_layer_bytes.values())) <= 1 else
        {str(layer): n for layer, n in per_layer_bytes.items()},
        "slot_bytes": slot, "total_expert_bytes": total,
        "layouts": [{"layers": g[0], "bytes": layout_bytes(src.layout_of(g[0][0])),
                     "tensors": [{"name": w[0], "dtype": w[1], "shape": w[2], "nbytes": w[4],
                                  **({"type": g[2][w[0]]} if w[0] in g[2] else {})} for w in g[1]]}
                    for g in groups],
        "sizing": {"pins_per_token": pins, "top_k_known": top_k is not None,
                   "arena_for_clients": {str(c): min(c * pins, len(src.keys)) * slot for c in CLIENTS},
                   "arena_whole_model": len(src.keys) * slot},
    }
    return out


def render(r: dict) -> str:
    """The human form of ``report``."""
    lines = [f"source    {r['source']['kind']} {r['source']['path']}",
             f"family    {r['family'] or '(none)'}" + (f"  rule {r['rule']}" if r["rule"] else "")]
    lines.append(f"layers    {len(r['layers'])} with experts: {span_text(r['layers'])}")
    k = r["top_k"]
    lines.append(f"experts   {r['experts_per_layer']} per layer, {r['experts']} in all; top-k "
                 f"{k if k is not None else 'unknown (config.json does not say; 1 assumed below)'}")
    lines.append(f"format    {r['tensor_format']}")
    many = len(r["layouts"]) > 1
    for g in r["layouts"]:
        head = f"layout    layers {span_text(g['layers'])}: " if many else "layout    "
        lines.append(f"{head}{show_size(g['bytes'])} per expert")
        for t in g["tensors"]:
            typ = f" ({t['type']})" if t.get("type") else ""
            lines.append(f"            {t['name']:<32} {t['dtype']:<8} {t['shape']}{typ}  {show_size(t['nbytes'])}")
    lines.append(f"total     {show_size(r['total_expert_bytes'])} of experts; slots of {show_size(r['slot_bytes'])}"
                 + (" (the largest layer's expert)" if many else ""))
    s = r["sizing"]
    lines.append(f"sizing    one client pins {s['pins_per_token']} slots per token "
                 f"({len(r['layers'])} layers x top-{k or 1}{'' if k else ' at least'})")
    arenas = ", ".join(f"{c} client{'s' if c != '1' else ''} {show_size(b, up=True)}"
                       for c, b in s["arena_for_clients"].items())
    lines.append(f"arena     {arenas}; whole model {show_size(s['arena_whole_model'], up=True)}")
    return "\n".join(lines)


def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help="describe what a checkpoint would serve (family, layers, layouts, "
                       "bytes, arena sizing) without starting the daemon")
    p.add_argument("src", help="safetensors directory/file, .gguf, .k3pack, or an http(s):// or s3:// URL")
    p.add_argument("--pattern", help="tensor name pattern with {layer}, {expert}, {name} (default: the family)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def main(args) -> int:
    try:
        src = open_source(args.src, args.pattern)
    except SourceError as e:
        print(f"k3d inspect: error: {e}", file=sys.stderr)
        return 1
    try:
        r = report(src)
    finally:
        src.close()
    print(json.dumps(r, indent=2) if args.json else render(r))
    return 0
