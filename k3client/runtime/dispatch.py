"""Which kernel computes an expert's run of rows under vLLM's numerics (``compute.fused``): the decision,
in one place.

``kernels(cpu, device_type, dtype, rowmm, rowmajor)`` gives a layer's ``Kernels``,
two row thresholds the runtime applies to each expert's run of ``n`` rows:

- ``n <= rowmm_rows``: the runtime's native kernel (``k3client.vllm.native.rowmm``)
  straight from the row-major bf16 view
  (float32 accumulation; in a float32 engine exactly the float32 math of the cast
  weights, so float32's token-for-token equality with plain vLLM holds);
- else torch, and where ``onednn_rows`` is set, with oneDNN (``torch.backends.mkldnn``)
  on exactly when ``n > onednn_rows`` (never turned on where the caller left it off);
  ``onednn_rows`` None leaves oneDNN as the caller set it.

The rules, per CPU (``k3client.cpu.CpuFacts``):

- float32 engine: rowmm for up to ``NATIVE_MAX_ROWS`` rows where it loaded and the
  views are row-major bf16, else torch as the caller left it (AMX has no float32
  multiply: the same on every CPU);
- bf16 engine, CPU with AMX: torch with oneDNN on for every run, whose bf16 matmul
  runs on the AMX tiles, as plain vLLM's own AMX MoE kernel does (rowmm's AVX-512 FMAs
  do 16 multiply-adds per instruction where a tile does 512 per cycle);
- bf16 engine, CPU without AMX: rowmm for up to ``NATIVE_MAX_ROWS`` rows where it loaded;
  otherwise ATen's reduced-precision gemv (oneDNN off) for up to ``NATIVE_ROWS`` rows:
  oneDNN repacks an unprepacked weight on every call, about twice the bytes ATen
  streams; oneDNN's blocked gemm from ``NATIVE_ROWS + 1`` rows on (bench/README.md,
  "vLLM overhead");
- fp16 engine: torch, ATen / oneDNN as for bf16 without rowmm (plain vLLM holds fp16
  casts of the bf16 weights; rowmm reads bf16);
- not a CPU (a CUDA engine): torch as the caller left it.

Pure functions (cached); any thread.  Imports no engine.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..cpu import CpuFacts

REDUCED = (torch.bfloat16, torch.float16)
# bf16/fp16 without AMX: an expert of at most NATIVE_ROWS rows computed by torch runs with oneDNN off
NATIVE_ROWS = 2
# an expert with at most this many rows goes to native.rowmm (which reads its weights once per
# native.ROWS rows); more (a prefill) to torch's gemm
NATIVE_MAX_ROWS = 16
NATIVE_DTYPES = (torch.bfloat16, torch.float32)     # engine dtypes whose math rowmm's is


@dataclass(frozen=True)
class Kernels:
    """A layer's kernel choice per run of ``n`` rows (see the module docstring)."""

    rowmm_rows: int = 0                 # runs of at most this many rows: native.rowmm (0: never)
    onednn_rows: int | None = None      # torch with oneDNN on iff n > this (None: as the caller left it)

    def describe(self) -> str:
        parts = [f"rowmm up to {self.rowmm_rows} rows"] if self.rowmm_rows else []
        if self.onednn_rows is None:
            parts.append("torch")
        elif self.onednn_rows == 0:
            parts.append("torch with oneDNN")
        else:
            parts.append(f"torch with oneDNN off up to {self.onednn_rows} rows, on above")
        return ", then ".join(parts)


@functools.lru_cache(maxsize=64)
def kernels(cpu: CpuFacts, device_type: str, dtype: torch.dtype, rowmm: bool, rowmajor: bool) -> Kernels:
    """The kernels for a layer of ``dtype`` on ``device_type``; ``rowmm``: native.rowmm loaded,
    ``rowmajor``: the layer's views are row-major bf16 (``native.eligible``)."""
    if device_type != "cpu":
        return Kernels()
    native = NATIVE_MAX_ROWS if rowmm and rowmajor and dtype in NATIVE_DTYPES else 0
    if dtype == torch.bfloat16 and cpu.amx:
        return Kernels(rowmm_rows=0, onednn_rows=0)
    if dtype in REDUCED:
        return Kernels(rowmm_rows=native if dtype == torch.bfloat16 else 0, onednn_rows=NATIVE_ROWS)
    return Kernels(rowmm_rows=native)
