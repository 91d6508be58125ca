"""k3client.vllm.native's one call per layer (``experts``) against the per-expert path, bit for bit.

``compute.fused`` runs twice over the same views, once with ``Runtime.native_layer`` (one
native call per group of experts) and once without (``native.gated_expert`` per expert,
scaled and summed in Python): the outputs must have the same bits.  Random bf16 weights
laid out as an arena slot holds them (gate, up, down back to back), read as the views
``k3client.runtime.views`` makes: one ``gate_up`` view, three views, and a tensor-parallel
rank's shard (strided down columns); float32 and bf16 engines, one token and four, each
group a whole layer or one expert (the sum carried between calls).  The fetch side is the
runtime's own, tested with a daemon elsewhere: here a stand-in yields the views.

Needs a CPU with AVX-512 and a C++ compiler (the op is built into torch's extension
directory the first time: about a minute here); skips in one line otherwise.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from k3client import cpu  # noqa: E402
from k3client.runtime import Activation, Layer, Standard, StepStats, compute, dispatch  # noqa: E402
from k3client.vllm import native, ranks  # noqa: E402

NAMES = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
E, K_TOP, H, INTER = 8, 2, 48, 96           # 48 = 16 * 3: ATen's vectorised loops have scalar tails


@pytest.fixture(scope="module")
def ops():
    rowmm, one = native.load(), native.load_layer()
    if rowmm is None or one is None:
        pytest.skip("native expert kernel unavailable here (no AVX-512 or no compiler; see the log)")
    return rowmm, one


class _Runtime:
    """What ``compute.fused`` reads of a ``Runtime``, with ``_groups`` yielding in-memory views in
    groups of ``size`` (as_ready: each group's experts in reverse, an arrival order)."""

    predict = False
    client = None

    def __init__(self, views, size, native_op, layer_op):
        self.views, self.size = views, size
        self.native, self.native_layer = native_op, layer_op
        self.stats = StepStats()
        self.ahead = SimpleNamespace(score=lambda layer, experts: None)
        self.gpu = SimpleNamespace(groups=lambda client, groups, device: groups)

    def _groups(self, ml, experts, predicted, as_ready=False):
        for i in range(0, len(experts), self.size):
            got = [(e, self.views[e]) for e in experts[i:i + self.size]]
            yield iter(got[::-1]) if as_ready else got


def _experts(layout, g):
    """Each expert's views, cut from one bf16 buffer as an arena slot lays gate, up and down."""
    out = {}
    for e in range(E):
        buf = (torch.randn(3 * INTER * H, generator=g) * 0.2).to(torch.bfloat16)
        gate_up, down = buf[:2 * INTER * H].view(2 * INTER, H), buf[2 * INTER * H:].view(H, INTER)
        if layout == "gate_up":
            out[e] = (gate_up, down)
        elif layout == "split":
            out[e] = (gate_up[:INTER], gate_up[INTER:], down)
        else:                                    # "tp1": rank 1 of 2, its down columns strided
            out[e] = ranks.Shard(1, 2).gated((gate_up, down))
            assert out[e][2].stride() == (INTER, 1)
    return out


def _bits(t):
    return t.contiguous().view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("layout", ["gate_up", "split", "tp1"])
@pytest.mark.parametrize("tokens", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", [E, 1])
def test_one_call_has_the_per_expert_paths_bits(ops, act, layout, tokens, dtype, size):
    kern = dispatch.kernels(cpu.facts(), "cpu", dtype, True, True)
    if not kern.rowmm_rows:
        pytest.skip(f"{dtype} experts go to torch on this CPU ({kern.describe()}): no native call to compare")
    rowmm, one = ops
    g = torch.Generator().manual_seed(tokens * 100 + len(layout) * 10 + len(act) + size)
    views = _experts(layout, g)
    ml = Layer(0, Activation(E, act), None, Standard(set(NAMES)), NAMES, dtype, top_k=K_TOP, rowmajor=True)
    x = torch.randn(tokens, H, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:K_TOP] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, K_TOP, generator=g), dim=-1)
    calls = []

    def layer_op(*a):
        calls.append(len(a[2]))
        return native.layer_experts(one, *a)

    per_expert = _Runtime(views, size, lambda *a: native.gated_expert(rowmm, *a), None)
    one_call = _Runtime(views, size, per_expert.native, layer_op)
    want = compute.fused(per_expert, ml, x, idx, w)
    got = compute.fused(one_call, ml, x, idx, w)
    union = len(set(idx.reshape(-1).tolist()))
    assert sum(calls) == union and len(calls) == -(-union // size)     # every expert, one call per group
    assert one_call.stats.native_experts == per_expert.stats.native_experts == union
    assert got.dtype == want.dtype == dtype and got.shape == (tokens, H)
    assert torch.equal(_bits(got), _bits(want))


def test_an_expert_parallel_rank_sums_only_its_experts(ops):
    rowmm, one = ops
    g = torch.Generator().manual_seed(5)
    views = _experts("split", g)
    ml = Layer(0, Activation(E, "silu"), None, Standard(set(NAMES)), NAMES, torch.float32, top_k=K_TOP,
               rowmajor=True, mine=frozenset(range(0, E, 2)))
    x = torch.randn(4, H, generator=g)
    idx = torch.tensor([[0, 1], [3, 2], [5, 7], [4, 6]])      # token 2 has none of this rank's experts
    w = torch.rand(4, K_TOP, generator=g)
    want = compute.fused(_Runtime(views, E, lambda *a: native.gated_expert(rowmm, *a), None), ml, x, idx, w)
    got = compute.fused(_Runtime(views, E, lambda *a: None, lambda *a: native.layer_experts(one, *a)), ml, x, idx, w)
    assert torch.equal(_bits(got), _bits(want)) and not got[2].any()


def test_the_op_refuses_what_it_cannot_read(ops):
    _, one = ops
    math = Activation(E, "silu")
    x = torch.zeros(1, 32)
    bf = torch.zeros(64, 32, dtype=torch.bfloat16)
    down = torch.zeros(32, 32, dtype=torch.bfloat16)          # [H, I]: gate_up is [2I, K]
    with pytest.raises(RuntimeError, match="w must be bfloat16"):
        native.layer_experts(one, math, [(bf.float(), down)], [1], 0, x, [1.0], [0], None)
    with pytest.raises(RuntimeError, match="token is outside x"):
        native.layer_experts(one, math, [(bf, down)], [1], 0, x, [1.0], [3], None)
    with pytest.raises(RuntimeError, match="rows outside the step's"):
        native.layer_experts(one, math, [(bf, down)], [2], 0, x, [1.0], [0], None)
