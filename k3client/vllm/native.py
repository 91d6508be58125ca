"""Small native ops for the plugin's CPU experts: ``rowmm`` (``x @ w.T`` over a row-major bf16 arena
view) and ``experts`` (a decode step's gated experts of one layer in one call).

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
- ``w``'s rows 8 KiB ahead are prefetched (a hint, no effect on the result): an
  expert's rows are too short for the hardware prefetcher to ramp up.

``experts`` (``layer_experts`` binds it): what ``compute.fused`` computes per expert
with ``gated_expert``, scaled by the routing weights and summed per token in ascending
expert order, in one call with no Python between experts, bit for bit the per-expert
path's result (``native_src`` says how; the unit test compares the bits).  The C++ of
both is ``native_src.SOURCE``.

Build: ``load()`` compiles ``native_src.SOURCE`` once per machine with
``torch.utils.cpp_extension.load_inline`` (``-O3 -mavx512f -ffp-contract=off``) into torch's extension
directory (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``; torch's
file lock makes concurrent engines build it once); about a minute on a 2-core VM,
then a load of the cached library.  Where the CPU has no AVX-512 (``k3client.cpu``), or
there is no compiler, ``load()`` returns None once and logs why in one line: the caller
computes with torch, as before.  Whether a loaded op is used is
``k3client.runtime.dispatch.kernels``' choice (a bf16 engine on an AMX CPU uses oneDNN instead).

Thread: ``load()``/``load_layer()`` may be called from any thread (a lock); both ops are
reentrant and split ``N`` over torch's intra-op threads (``at::parallel_for``).
"""

from __future__ import annotations

import logging
import threading

import torch

from .. import cpu
from .native_src import SOURCE

log = logging.getLogger("k3client.vllm")

ROWS = 8              # activation rows per pass over w (one accumulator register each)
# the build's name in torch's extension directory: a new one with every change of native_src.SOURCE
NAME = "k3d_rowmm_2"
# Layer.module.activation -> the ``act`` code of ``experts`` (native_src)
ACT_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2}

_lock = threading.Lock()
_state: dict = {}        # "mod": the compiled module, or None once a load failed (not retried)


def _module():
    """The compiled module (``rowmm``, ``experts``) or None (no AVX-512, no compiler, a failed build:
    logged once)."""
    with _lock:
        if "mod" in _state:
            return _state["mod"]
        mod = None
        facts = cpu.facts()
        if not facts.avx512:
            log.warning("k3client.vllm: the CPU has %s; experts computed with torch", facts.describe())
        else:
            try:
                from torch.utils.cpp_extension import load_inline

                # -ffp-contract=off: experts' scale-and-add must round as torch's mul_ then add_ do
                mod = load_inline(NAME, cpp_sources=SOURCE, functions=["rowmm", "experts"],
                                  extra_cflags=["-O3", "-mavx512f", "-ffp-contract=off"], verbose=False)
            except Exception as e:          # no compiler, no ninja, a build error: torch computes
                log.warning("k3client.vllm: native expert kernel unavailable (%s: %s); experts computed "
                            "with torch", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        _state["mod"] = mod
        return mod


def load():
    """The compiled ``rowmm`` or None (see ``_module``)."""
    mod = _module()
    return mod.rowmm if mod is not None else None


def load_layer():
    """The compiled ``experts`` (one call per layer, ``native_src``) or None (see ``_module``)."""
    mod = _module()
    return mod.experts if mod is not None else None


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


def layer_experts(op, math, views, counts, at, x, scales, tokens, reduced, out=None):
    """A run of a layer's gated experts in one native call (``native_src``'s ``experts``), with the
    bits of ``gated_expert`` per expert, scaled and summed per token as ``compute.fused`` sums them.

    ``views``: each expert's views, ascending; ``counts``: their rows, from row ``at`` of the
    step's order; ``x``: the step's rows, float32 (one row: one token); ``scales``/``tokens``:
    every row's routing weight and token (lists); ``reduced``: a bf16 engine's dtype, else None;
    ``out``: the float32 sum so far (None: the first run of the layer).  Returns the sum."""
    return op(x, views, counts, at, scales, tokens, ACT_CODES[math.activation], reduced is not None, out)
