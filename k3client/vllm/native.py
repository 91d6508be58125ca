"""A small native op for the plugin's CPU experts: ``x @ w.T`` over a row-major bf16 arena view.

Why: a decode step gives each expert 1-4 rows.  torch has no good kernel for that
shape over a plain bf16 weight: ATen's bf16 gemm (oneDNN off) is compute-bound from
two rows on, oneDNN repacks the weight on every call, and vLLM's own fused MoE kernel
reads only the blocked layout it prepacks at load, which arena views are not
(bench/README.md, "vLLM overhead: a kernel over arena views").  This op streams the
view once for up to ``ROWS`` rows: per output row ``n`` of ``w``, 16-wide fp32
partial sums over ``k``, one per activation row, so it is memory-bound like vLLM's.

Layout and invariants (checked in C++; a view that breaks them is a one-line error):
- ``w``: bf16 ``[N, K]``, elements of a row contiguous (``stride(1) == 1``), any row
  stride (an arena view as ``Expert.tensor`` gives it), ``K % 16 == 0``; never written;
- ``x``: float32 ``[M, K]``, ``stride(1) == 1`` (a ``chunk`` of a wider tensor is fine);
- result: a new float32 ``[M, N]``; each element is the fp32 sum of ``x[m, k] * w[n, k]``
  in 16 lane-wise partial sums (``k`` mod 16, in ``k`` order, fused multiply-add),
  then added by ``_mm512_reduce_add_ps``.  Rows are taken ``ROWS`` at a time (a
  prefill's 100 rows read ``w`` 13 times: ``k3client.runtime.compute.fused``
  sends those to torch).
- float32 activations with bf16 weights: a float32 engine computes on the arena's
  bf16 values exactly as if they were cast to float32 first (the cast is exact),
  with no cast.

Build: ``load()`` compiles the C++ below once per machine with
``torch.utils.cpp_extension.load_inline`` (``-O3 -mavx512f``) into torch's extension
directory (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``; torch's
file lock makes concurrent engines build it once); about a minute on a 2-core VM,
then a load of the cached library.  Where the CPU has no AVX-512 (``k3client.cpu``), or
there is no compiler, ``load()`` returns None once and logs why in one line: the caller
computes with torch, as before.  Whether a loaded op is used is
``k3client.runtime.dispatch.kernels``' choice (a bf16 engine on an AMX CPU uses oneDNN instead).

Thread: ``load()`` may be called from any thread (a lock); ``rowmm`` is reentrant and
splits ``N`` over torch's intra-op threads (``at::parallel_for``).
"""

from __future__ import annotations

import logging
import threading

import torch

from .. import cpu

log = logging.getLogger("k3client.vllm")

ROWS = 8              # activation rows per pass over w (one accumulator register each)
# the build's name in torch's extension directory: a new one with every change of _SOURCE
NAME = "k3d_rowmm_1"
_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

// M rows of x against rows [n0, n1) of w: out[m, n] = sum_k x[m, k] * w[n, k].  (Unrolling over
// 2-4 rows of w, for more independent FMA chains at M = 1, measured slower here: not done.)
template <int M>
static void block(const float* x, int64_t ldx, const uint16_t* w, int64_t ldw, float* out, int64_t ldo,
                  int64_t n0, int64_t n1, int64_t K) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* wr = w + n * ldw;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      // bf16 -> fp32 is a 16-bit shift: exact
      __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + k));
      __m512 wf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
      for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * ldx + k), wf, acc[m]);
    }
    for (int m = 0; m < M; ++m) out[m * ldo + n] = _mm512_reduce_add_ps(acc[m]);
  }
}

template <int M>
static void rows(const float* x, int64_t ldx, const uint16_t* w, int64_t ldw, float* out, int64_t N, int64_t K) {
  // 64 output rows of w per task: a few KiB of w, enough to amortise a task
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) { block<M>(x, ldx, w, ldw, out, N, n0, n1, K); });
}

torch::Tensor rowmm(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "rowmm: x and w must be 2-D");
  TORCH_CHECK(x.scalar_type() == torch::kFloat, "rowmm: x must be float32");
  TORCH_CHECK(w.scalar_type() == torch::kBFloat16, "rowmm: w must be bfloat16");
  TORCH_CHECK(x.stride(1) == 1 && w.stride(1) == 1, "rowmm: rows of x and w must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && K % 16 == 0, "rowmm: w must be [N, K] with K a multiple of 16");
  auto out = torch::empty({M, N}, x.options());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    const float* xp = x.data_ptr<float>() + m0 * x.stride(0);
    float* op = out.data_ptr<float>() + m0 * N;
    switch (std::min<int64_t>(8, M - m0)) {
      case 1: rows<1>(xp, x.stride(0), wp, w.stride(0), op, N, K); break;
      case 2: rows<2>(xp, x.stride(0), wp, w.stride(0), op, N, K); break;
      case 3: rows<3>(xp, x.stride(0), wp, w.stride(0), op, N, K); break;
      case 4: rows<4>(xp, x.stride(0), wp, w.stride(0), op, N, K); break;
      case 5: rows<5>(xp, x.stride(0), wp, w.stride(0), op, N, K); break;
      case 6: rows<6>(xp, x.stride(0), wp, w.stride(0), op, N, K); break;
      case 7: rows<7>(xp, x.stride(0), wp, w.stride(0), op, N, K); break;
      default: rows<8>(xp, x.stride(0), wp, w.stride(0), op, N, K); break;
    }
  }
  return out;
}
"""

_lock = threading.Lock()
_state: dict = {}        # "op": the compiled rowmm, or None once a load failed (not retried)


def load():
    """The compiled ``rowmm`` or None (no AVX-512, no compiler, a failed build: logged once)."""
    with _lock:
        if "op" in _state:
            return _state["op"]
        op = None
        facts = cpu.facts()
        if not facts.avx512:
            log.warning("k3client.vllm: the CPU has %s; experts computed with torch", facts.describe())
        else:
            try:
                from torch.utils.cpp_extension import load_inline

                mod = load_inline(NAME, cpp_sources=_SOURCE, functions=["rowmm"],
                                  extra_cflags=["-O3", "-mavx512f"], verbose=False)
                op = mod.rowmm
            except Exception as e:          # no compiler, no ninja, a build error: torch computes
                log.warning("k3client.vllm: native expert kernel unavailable (%s: %s); experts computed "
                            "with torch", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        _state["op"] = op
        return op


def eligible(specs, family, tp: int = 1) -> bool:
    """A gated layer whose gate/up/down are bf16 ``[N, K]`` with ``K % 16 == 0`` (what ``rowmm`` reads);
    on a rank of ``tp`` tensor-parallel ranks the down projection's ``K`` is its shard, ``K / tp``
    columns of the row-major view (``ranks.Shard``: strided, which ``rowmm`` takes)."""
    by = {s.name: s for s in specs}
    names = (family.gate_up,) if family.gate_up is not None else (family.gate, family.up)
    ts = [by.get(n) for n in (*names, family.down)]
    if not all(t is not None and t.dtype == "BF16" and len(t.shape) == 2 and t.shape[1] % 16 == 0 for t in ts):
        return False
    down = ts[-1].shape[1]
    return down % tp == 0 and (down // tp) % 16 == 0


def gated_expert(op, math, views, x, reduced):
    """``act(x W_gate^T) * (x W_up^T) W_down^T`` in float32 (``views`` as
    ``k3client.runtime.compute.gated_expert``'s).

    ``x``: the expert's rows, float32 (``compute.fused`` converts a step's rows once) or the
    engine's dtype.  ``reduced`` (a bf16/fp16 engine: that dtype, else None): the activation
    is rounded to it before the down projection, where vLLM's fused kernel rounds it; the
    result stays float32 for the caller to scale and sum."""
    xf = x if x.dtype == torch.float32 else x.float()
    if len(views) == 2:
        gate, up = op(xf, views[0]).chunk(2, dim=-1)
    else:
        gate, up = op(xf, views[0]), op(xf, views[1])
    h = math.act_fn(gate).mul_(up)
    if reduced is not None:
        h = h.to(reduced).float()
    return op(h, views[-1])
