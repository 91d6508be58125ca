"""Arena size sanity checks at start: warnings, not errors (the daemon still starts).

- Fewer slots than one token pins: every MoE layer of a token pins its top-k
  experts until the client's next ``begin_token``, so an arena below
  ``layers x top_k`` slots answers ``cache full`` to a single client mid-token.
  ``top_k`` comes from the checkpoint's ``config.json`` when the source is a
  local directory that has one (``num_experts_per_tok`` and its spellings),
  else 1 (the least any token pins).
- Far more slots than the model has experts: the surplus is memory taken and
  pre-faulted at every start for nothing.

Pure functions of the source's description and the slot count; called once by
``k3d.service.daemon`` before the arena is built.
"""

from __future__ import annotations

import json
import os

from k3d.sizes import show_size

TOPK_KEYS = ("num_experts_per_tok", "num_experts_per_token", "experts_per_token", "moe_top_k", "top_k")
SURPLUS = 1.25          # slots above this many times the model's experts are called waste


def top_k(path: str) -> int | None:
    """The router's top-k from ``config.json`` beside a local checkpoint, if it says."""
    d = path if os.path.isdir(path) else os.path.dirname(path)
    try:
        with open(os.path.join(d, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    for section in (cfg, cfg.get("text_config") or {}):
        for key in TOPK_KEYS:
            v = section.get(key) if isinstance(section, dict) else None
            if type(v) is int and v > 0:
                return v
    return None


def arena_warnings(slots: int, slot_bytes: int, model: dict) -> list[str]:
    """Warnings for an arena of ``slots`` serving ``model`` (a source's ``describe()``)."""
    out = []
    layers = len(model.get("layers") or [])     # the layers with experts (describe lists each one)
    k = model.get("top_k")                      # the family's, from config.json or GGUF metadata
    if not k and not str(model["path"]).startswith(("http://", "https://", "s3://")):
        k = top_k(model["path"])
    need = layers * (k or 1)
    if slots < need:
        out.append(f"the arena holds {slots} slots but one token pins {need} ({layers} layers x top-{k or 1}"
                   f"{'' if k else ' at least'}): a client will get 'cache full' mid-token; raise --arena to at "
                   f"least {show_size(need * slot_bytes, up=True)} (--slots {need})")
    count = model.get("count", 0)
    if count and slots > SURPLUS * count:
        out.append(f"the arena holds {slots} slots but the model has only {count} experts: "
                   f"{show_size((slots - count) * slot_bytes)} will never be used; --slots {count} "
                   f"(--arena {show_size(count * slot_bytes, up=True)}) holds all of it")
    return out
