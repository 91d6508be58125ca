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

``write_synthetic_gguf``: a small MoE GGUF (stacked ``*_exps``, quantized with
``gguf.quants``) written by the reference writer; tests and benchmarks only
(it needs the ``gguf`` library, the test extra).

Thread: the caller's; these write files and keep no state.
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


def write_synthetic_gguf(path: str, layers: int = 2, experts: int = 8, hidden: int = 256, inter: int = 128,
                         types=("MXFP4", "MXFP4", "MXFP4"), bias: bool = False, seed: int = 0) -> str:
    """Write a small MoE GGUF with the reference writer (``gguf.GGUFWriter``); for tests and benchmarks.

    Per layer: ``ffn_gate_inp.weight`` F32 [experts, hidden] (the router), stacked
    ``ffn_{gate,up,down}_exps.weight`` quantized with ``gguf.quants`` to ``types``
    (gate, up, down; e.g. MXFP4, Q8_0, F16), optionally ``ffn_gate_exps.bias`` F32,
    and a non-expert ``attn_q.weight`` the source must ignore.  Needs the gguf library.
    """
    # lazily: gguf is the test extra, and the demo imports this module without it
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    w = GGUFWriter(path, "qwen3moe")
    w.add_block_count(layers)
    w.add_expert_count(experts)
    w.add_embedding_length(hidden)
    w.add_expert_feed_forward_length(inter)
    for layer in range(layers):
        w.add_tensor(f"blk.{layer}.attn_q.weight", rng.standard_normal((hidden, hidden)).astype(np.float16))
        w.add_tensor(f"blk.{layer}.ffn_gate_inp.weight", rng.standard_normal((experts, hidden)).astype(np.float32))
        for part, tname, (rows, cols) in (("gate", types[0], (inter, hidden)), ("up", types[1], (inter, hidden)),
                                          ("down", types[2], (hidden, inter))):
            x = (rng.standard_normal((experts, rows, cols)) / np.sqrt(cols)).astype(np.float32)
            qt = GGMLQuantizationType[tname]
            if qt in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                w.add_tensor(f"blk.{layer}.ffn_{part}_exps.weight",
                             x.astype(np.float16 if tname == "F16" else np.float32))
            else:
                w.add_tensor(f"blk.{layer}.ffn_{part}_exps.weight", quantize(x, qt), raw_dtype=qt)
        if bias:
            w.add_tensor(f"blk.{layer}.ffn_gate_exps.bias", rng.standard_normal((experts, inter)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
