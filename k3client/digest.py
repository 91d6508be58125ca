"""The content digest of a checkpoint's routed experts: the rule both sides compute.

The daemon computes it from its source at start-up (``k3d.sources.digest``) and
sends it in ``hello`` (``model.digest``); a client computes it from a local
checkpoint (``k3client.local``) and compares (``Client.verify``).  This module is
the rule only: pure functions of layouts and bytes, no I/O, safe from any thread.

The rule (``RULE``; a change of any step is a new rule id):

1. Every expert tensor instance is tensor ``name`` of expert ``(layer, e)`` as the
   daemon serves it in a slot: ``nbytes`` bytes, whatever file format holds them
   (for a stacked ``[E, ...]`` tensor, expert ``e``'s slice).
2. Its sampled bytes (``sample_ranges``): all of them when ``nbytes <=
   BLOCKS * BLOCK`` (32 KiB); else ``BLOCKS`` blocks of ``BLOCK`` bytes starting at
   ``i * (nbytes - BLOCK) // (BLOCKS - 1)`` for ``i = 0 .. BLOCKS - 1``: the first
   block, the last, and six evenly spread between.  Positions count from the
   tensor's first byte, so the pack, the GGUF slab and the safetensors tensor of
   one expert give the same samples.
3. ``tensor_hash``: blake2b-128 (person ``k3d-tensor``) of ``nbytes`` (u64 LE) and
   the sampled bytes in order.
4. One *part* per (layer, tensor name): blake2b-64 (person ``k3d-part``) of
   ``e`` (u32 LE) and the tensor hash of every expert ``e`` of the layer, ascending.
   A part is ``[layer, name, dtype, shape, experts, hex16]``.
5. The digest ``hex``: blake2b-128 (person ``k3d-digest``) of the canonical JSON of
   ``[RULE, parts]``, parts sorted by (layer, name).

So the digest covers the layout (layers, names, dtypes, shapes, expert counts) and
``BLOCKS * BLOCK`` bytes of every expert tensor: at most 32 KiB per tensor, a
fixed number of bytes whatever its size (``sampled_bytes``).  A fine-tune changes
practically every value of the tensors it touches, so any sample of them differs;
an edit confined to bytes no block covers is not seen (the daemon's own per-read
checks, the pack crc32, cover the bytes it serves, not this comparison).
"""

from __future__ import annotations

import hashlib
import json

RULE = "k3d-digest/1"
BLOCK = 4096
BLOCKS = 8


def sample_ranges(nbytes: int) -> list[tuple[int, int]]:
    """``[(start, length)]`` of the bytes sampled from a tensor of ``nbytes`` (rule step 2)."""
    if nbytes <= BLOCK * BLOCKS:
        return [(0, nbytes)] if nbytes else []
    span = nbytes - BLOCK
    return [(i * span // (BLOCKS - 1), BLOCK) for i in range(BLOCKS)]


def sampled_bytes(nbytes: int) -> int:
    """Bytes the rule reads from one tensor of ``nbytes``."""
    return sum(n for _, n in sample_ranges(nbytes))


def tensor_hash(nbytes: int, chunks) -> bytes:
    """Rule step 3: ``chunks`` are the sampled ranges' bytes, in ``sample_ranges`` order."""
    h = hashlib.blake2b(digest_size=16, person=b"k3d-tensor")
    h.update(nbytes.to_bytes(8, "little"))
    for c in chunks:
        h.update(c)
    return h.digest()


def part_hash(per_expert: dict[int, bytes]) -> str:
    """Rule step 4: ``{expert: tensor_hash}`` of one (layer, name) -> 16 hex digits."""
    h = hashlib.blake2b(digest_size=8, person=b"k3d-part")
    for e in sorted(per_expert):
        h.update(int(e).to_bytes(4, "little"))
        h.update(per_expert[e])
    return h.hexdigest()


def assemble(specs: dict[int, list[tuple[str, str, tuple]]], hashes: dict[tuple[int, int], dict[str, bytes]],
             **extra) -> dict:
    """The digest from ``{layer: [(name, dtype, shape)]}`` and ``{(layer, e): {name: tensor_hash}}``.

    Returns ``{"rule", "hex", "parts", **extra}`` (what ``hello``'s ``model.digest`` carries)."""
    by_part: dict[tuple[int, str], dict[int, bytes]] = {}
    for (layer, e), named in hashes.items():
        for name, h in named.items():
            by_part.setdefault((layer, name), {})[e] = h
    parts = []
    for layer in sorted(specs):
        for name, dtype, shape in sorted(specs[layer]):
            per = by_part.get((layer, name), {})
            parts.append([layer, name, dtype, list(shape), len(per), part_hash(per)])
    return {"rule": RULE, "hex": digest_hex(parts), "parts": parts, **extra}


def digest_hex(parts: list) -> str:
    """Rule step 5."""
    text = json.dumps([RULE, [list(p[:3]) + [list(p[3])] + list(p[4:]) for p in parts]], separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=16, person=b"k3d-digest").hexdigest()


def first_difference(served: dict, local: dict) -> str | None:
    """Where two digests first differ, in words (None when they are equal)."""
    if served.get("hex") == local.get("hex") and served.get("rule") == local.get("rule"):
        return None
    if served.get("rule") != local.get("rule"):
        return f"digest rule {served.get('rule')!r} is not this client's {local.get('rule')!r}"
    theirs = {(p[0], p[1]): p for p in served.get("parts") or []}
    mine = {(p[0], p[1]): p for p in local.get("parts") or []}
    layers_a, layers_b = sorted({k[0] for k in theirs}), sorted({k[0] for k in mine})
    if layers_a != layers_b:
        return f"expert layers {span_text(layers_a)} served, {span_text(layers_b)} locally"
    for layer in layers_a:
        names_a = sorted(n for l, n in theirs if l == layer)
        names_b = sorted(n for l, n in mine if l == layer)
        if names_a != names_b:
            return f"layer {layer} has expert tensors [{', '.join(names_a)}] served, [{', '.join(names_b)}] locally"
    for key in sorted(theirs):
        a, b = theirs[key], mine[key]
        layer, name = key
        if (a[2], list(a[3])) != (b[2], list(b[3])):
            return f"layer {layer} tensor {name} is {a[2]} {list(a[3])} served, {b[2]} {list(b[3])} locally"
        if a[4] != b[4]:
            return f"layer {layer} tensor {name}: {a[4]} experts per layer served, {b[4]} per layer locally"
        if a[5] != b[5]:
            return (f"layer {layer} tensor {name} holds other bytes (sampled; the same layout with other "
                    "values, e.g. a fine-tune)")
    return "the parts agree but the digests do not"


def span_text(values) -> str:
    """``[0, 1, 2, 5, 7, 9]`` -> ``0-2, 5, 7, 9`` (layers, for messages; the daemon's too)."""
    out, vals, i = [], sorted(values), 0
    while i < len(vals):
        j = i
        while j + 1 < len(vals) and vals[j + 1] == vals[j] + 1:
            j += 1
        out.append(f"{vals[i]}-{vals[j]}" if j > i else f"{vals[i]}")
        i = j + 1
    return ", ".join(out) or "none"
