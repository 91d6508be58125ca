"""The layout of one expert inside a slot, and dtype names.

A slot holds one expert: every tensor of the layout at ``offset`` (64-byte
aligned, in sorted name order), ``nbytes`` long.  The layout is the same for
every expert of a layer, so a client computes a tensor's address as
``slot * slot_bytes + spec.offset`` with no per-expert metadata.  Layers may
have different layouts (a GGUF Q4_K_M mix gives some layers' ``ffn_down_exps``
Q6_K, others Q4_K): the daemon then sends ``model.layouts`` =
``[[[layers...], [TensorSpec wire...], {name: tensor type}], ...]`` and every slot
is sized to the largest expert (``layouts_from_wire`` reads it).

Dtype names are the safetensors ones (``U8``, ``F16``, ``BF16`` ...).  numpy has
no bfloat16 (or fp8): ``numpy_dtype`` returns the same-width unsigned integer for
those, so ``Expert.array`` still gives the exact bits; ``Expert.tensor`` gives the
real torch dtype.

Pure data and functions: no state, safe from any thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TENSOR_ALIGN = 64

# name -> (itemsize, numpy dtype or bit-equivalent, torch dtype attribute)
DTYPES: dict[str, tuple[int, str, str]] = {
    "BOOL": (1, "bool", "bool"),
    "U8": (1, "uint8", "uint8"),
    "I8": (1, "int8", "int8"),
    "F8_E4M3": (1, "uint8", "float8_e4m3fn"),
    "F8_E5M2": (1, "uint8", "float8_e5m2"),
    "I16": (2, "int16", "int16"),
    "U16": (2, "uint16", "uint16"),
    "F16": (2, "float16", "float16"),
    "BF16": (2, "uint16", "bfloat16"),
    "I32": (4, "int32", "int32"),
    "U32": (4, "uint32", "uint32"),
    "F32": (4, "float32", "float32"),
    "I64": (8, "int64", "int64"),
    "U64": (8, "uint64", "uint64"),
    "F64": (8, "float64", "float64"),
}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the expert layout: where it lies inside a slot."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def to_wire(self) -> list:
        return [self.name, self.dtype, list(self.shape), self.offset, self.nbytes]

    @classmethod
    def from_wire(cls, w) -> "TensorSpec":
        name, dtype, shape, offset, nbytes = w
        return cls(name, dtype, tuple(int(s) for s in shape), int(offset), int(nbytes))


def itemsize(dtype: str) -> int:
    return DTYPES[dtype][0]


def numpy_dtype(dtype: str) -> np.dtype:
    return np.dtype(DTYPES[dtype][1])


def align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def build_layout(tensors: list[tuple[str, str, tuple[int, ...], int]]) -> list[TensorSpec]:
    """Place ``(name, dtype, shape, nbytes)`` tensors in sorted name order."""
    specs, off = [], 0
    for name, dtype, shape, nbytes in sorted(tensors):
        specs.append(TensorSpec(name, dtype, tuple(shape), off, nbytes))
        off = align(off + nbytes, TENSOR_ALIGN)
    return specs


def layouts_from_wire(groups) -> dict[int, list[TensorSpec]]:
    """{layer: layout} from ``model.layouts`` (empty when every layer has the one ``layout``)."""
    out: dict[int, list[TensorSpec]] = {}
    for layers, wire, *_types in groups or []:
        layout = [TensorSpec.from_wire(w) for w in wire]
        for layer in layers:
            out[int(layer)] = layout
    return out


def layout_bytes(layout: list[TensorSpec]) -> int:
    """Bytes one expert spans (last tensor's end)."""
    return max((s.offset + s.nbytes for s in layout), default=0)
