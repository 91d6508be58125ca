"""Real-sized MoE checkpoints as sparse files: DeepSeek-V3's shapes, Kimi-K2's counts.

A shipped checkpoint's expert bytes (~650 GB for DeepSeek-V3) cannot be written
for a test, but what the daemon does at start-up depends only on the headers,
the tensor count and the file sizes.  So each shard is a safetensors file whose
header is written here (the format's own layout: an 8-byte little-endian
length, then JSON with ``dtype``, ``shape`` and ``data_offsets`` per tensor,
padded with spaces to 8 bytes) and whose data is a hole (``ftruncate``): it
reads as zeros and takes no disk.  A few experts get a ``MARK`` pattern at the
start of their first tensor (``marked``), so a test can tell served bytes from
zeros.  The safetensors library reads these headers like any other.

Shapes (``SHAPES``), per routed expert: ``gate_proj``/``up_proj`` F8_E4M3
[inter, hidden], ``down_proj`` [hidden, inter], each with its F32
``weight_scale_inv`` per 128 x 128 block, as DeepSeek-V3 ships them;
``first_k_dense`` layers with a dense MLP only; one shard per layer with a
``model.safetensors.index.json``, and a ``config.json`` naming the family.

Pure function of its arguments; writes only under the directory it is given.
Used by ``tests/integration/test_real_counts.py`` and ``bench/real_counts.py``.
"""

from __future__ import annotations

import json
import os
import struct

# name -> (layers, routed experts, hidden, moe inter, first dense layers, top-k)
SHAPES = {
    "deepseek-v3": (61, 256, 7168, 2048, 3, 8),      # 58 MoE layers x 256: ~650 GB of experts
    "kimi-k2": (61, 384, 7168, 2048, 1, 8),          # 60 MoE layers x 384: ~1 TB of experts
}
MARK = bytes(range(1, 65))
DTYPE_BYTES = {"F8_E4M3": 1, "F32": 4, "BF16": 2}


def expert_tensors(hidden: int, inter: int) -> list[tuple[str, str, list[int]]]:
    """(name, dtype, shape) of one routed expert's tensors, in file order."""
    out = []
    for name, (rows, cols) in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                               ("down_proj", (hidden, inter))):
        out.append((f"{name}.weight", "F8_E4M3", [rows, cols]))
        out.append((f"{name}.weight_scale_inv", "F32", [-(-rows // 128), -(-cols // 128)]))
    return out


def expert_bytes(hidden: int, inter: int) -> int:
    return sum(DTYPE_BYTES[d] * s[0] * s[1] for _, d, s in expert_tensors(hidden, inter))


def _write_shard(path: str, tensors: list[tuple[str, str, list[int]]], marks: dict[str, bytes]) -> int:
    """Header by hand, data a hole; ``marks``: tensor name -> bytes written at its start.
    Returns the file's size."""
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape in tensors:
        n = DTYPE_BYTES[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    base = 8 + len(raw)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(base + off)
        for name, data in marks.items():
            f.seek(base + header[name]["data_offsets"][0])
            f.write(data)
    return base + off


def write_sparse_checkpoint(path: str, shape: str = "deepseek-v3", marked=((3, 0), (3, 255))) -> str:
    """Write checkpoint ``shape`` (a ``SHAPES`` name) into directory ``path``; the experts in
    ``marked`` start with ``MARK``.  Returns ``path``."""
    layers, experts, hidden, inter, dense, topk = SHAPES[shape]
    os.makedirs(path, exist_ok=True)
    per_expert = expert_tensors(hidden, inter)
    weight_map = {}
    shards = layers
    for layer in range(layers):
        fname = f"model-{layer + 1:05d}-of-{shards:05d}.safetensors"
        p = f"model.layers.{layer}."
        tensors = [(p + "input_layernorm.weight", "BF16", [hidden])]
        marks = {}
        if layer < dense:
            tensors += [(p + f"mlp.{n}.weight", "F8_E4M3", s) for n, s in (
                ("gate_proj", [4 * inter, hidden]), ("up_proj", [4 * inter, hidden]),
                ("down_proj", [hidden, 4 * inter]))]
        else:
            tensors += [(p + "mlp.gate.weight", "BF16", [experts, hidden]),
                        (p + "mlp.gate.e_score_correction_bias", "F32", [experts])]
            for e in range(experts):
                tensors += [(p + f"mlp.experts.{e}.{n}", d, s) for n, d, s in per_expert]
                if (layer, e) in marked:
                    marks[p + f"mlp.experts.{e}.{per_expert[0][0]}"] = MARK
            tensors += [(p + f"mlp.shared_experts.{n}.weight", "F8_E4M3", s) for n, s in (
                ("gate_proj", [inter, hidden]), ("up_proj", [inter, hidden]), ("down_proj", [hidden, inter]))]
        _write_shard(os.path.join(path, fname), tensors, marks)
        weight_map.update({name: fname for name, _, _ in tensors})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
                   "num_hidden_layers": layers, "n_routed_experts": experts, "num_experts_per_tok": topk,
                   "first_k_dense_replace": dense, "hidden_size": hidden, "moe_intermediate_size": inter,
                   "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                           "weight_block_size": [128, 128]}}, f)
    return path
