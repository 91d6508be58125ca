"""A small synthetic MXFP4-shaped MoE checkpoint, written by the safetensors library.

Per expert (OCP/compressed-tensors layout, as gpt-oss ships it)::

    w1.weight_packed  U8 [inter, hidden/2]    w1.weight_scale  U8 [inter, hidden/32]
    w3.weight_packed  U8 [inter, hidden/2]    w3.weight_scale  U8 [inter, hidden/32]
    w2.weight_packed  U8 [hidden, inter/2]    w2.weight_scale  U8 [hidden, inter/32]

Scales are valid E8M0 (never 0xFF).  Non-expert tensors (router, norm) are
written too, so the source must ignore them.  With ``shards > 1`` the layers
are spread over shards with a ``model.safetensors.index.json``.  Used by the
demo, the tests and the benchmarks.  Pure function of its arguments and seed,
run in the caller's thread; it writes only under the directory it is given.
"""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors.numpy import save_file

NAME = "model.layers.{layer}.mlp.experts.{expert}.{name}"


def expert_tensors(rng, hidden: int, inter: int) -> dict[str, np.ndarray]:
    out = {}
    for w, (rows, cols) in (("w1", (inter, hidden)), ("w3", (inter, hidden)), ("w2", (hidden, inter))):
        out[f"{w}.weight_packed"] = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
        out[f"{w}.weight_scale"] = rng.integers(118, 130, (rows, cols // 32), dtype=np.uint8)
    return out


def write_checkpoint(path: str, layers: int = 4, experts: int = 16, hidden: int = 512,
                     inter: int = 256, shards: int = 1, seed: int = 0) -> str:
    """Write the checkpoint into directory ``path``; returns ``path``."""
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    per_shard = -(-layers // shards)
    weight_map = {}
    for sh in range(shards):
        tensors = {}
        for layer in range(sh * per_shard, min(layers, (sh + 1) * per_shard)):
            router = rng.standard_normal((experts, hidden)).astype(np.float16)
            tensors[f"model.layers.{layer}.mlp.router.weight"] = router
            tensors[f"model.layers.{layer}.post_attention_layernorm.weight"] = np.ones(hidden, np.float32)
            for e in range(experts):
                for name, arr in expert_tensors(rng, hidden, inter).items():
                    tensors[NAME.format(layer=layer, expert=e, name=name)] = arr
        fname = "model.safetensors" if shards == 1 else f"model-{sh + 1:05d}-of-{shards:05d}.safetensors"
        save_file(tensors, os.path.join(path, fname), metadata={"format": "k3d-synthetic"})
        weight_map.update({n: fname for n in tensors})
    if shards > 1:
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return path
