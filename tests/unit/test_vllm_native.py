"""k3client.vllm.native: the row-major bf16 expert kernel against float64 references.

Needs torch, a CPU with AVX-512 and a C++ compiler (the first run builds the op into
torch's extension directory, ``TORCH_EXTENSIONS_DIR``: about a minute here); skips
in one line otherwise.  No vLLM needed.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from k3client.vllm import native  # noqa: E402


@pytest.fixture(scope="module")
def rowmm():
    op = native.load()
    if op is None:
        pytest.skip("native expert kernel unavailable here (no AVX-512 or no compiler; see the log)")
    return op


def _bf16_view(n, k, pad, g):
    """A [n, k] bf16 view with a row stride of k + pad, as an arena slot gives tensors."""
    buf = torch.randn(n * (k + pad), generator=g).to(torch.bfloat16)
    return buf.as_strided((n, k), (k + pad, 1))


@pytest.mark.parametrize("m", [1, 2, 3, 7, 8, 9, 17])
@pytest.mark.parametrize("n,k", [(64, 32), (2048, 512), (48, 1024)])
def test_rowmm_is_x_times_w_transposed(rowmm, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = _bf16_view(n, k, 48, g)
    x = torch.randn(m, 2 * k, generator=g)[:, :k]                 # rows of a wider tensor
    got = rowmm(x, w)
    ref = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T                  # float32 sums: relative to |x||w|
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert ((got.double() - ref).abs() / scale).max().item() < 1e-6


def test_rowmm_refuses_what_it_cannot_read(rowmm):
    w = torch.zeros(32, 24, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        rowmm(torch.zeros(1, 24), w)
    with pytest.raises(RuntimeError, match="bfloat16"):
        rowmm(torch.zeros(1, 32), torch.zeros(8, 32))
    with pytest.raises(RuntimeError, match="float32"):
        rowmm(torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(8, 32, dtype=torch.bfloat16))


class _Math:
    act_fn = staticmethod(F.silu)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_expert_matches_torch(rowmm, split, dtype):
    """float32 engine: the cast-then-linear result within float32 rounding; bf16: the
    activation rounded to bf16 once, as vLLM's fused kernel rounds it."""
    g = torch.Generator().manual_seed(7)
    hidden, inter = 256, 512
    gate_up, down = _bf16_view(2 * inter, hidden, 0, g), _bf16_view(hidden, inter, 16, g)
    views = (gate_up[:inter], gate_up[inter:], down) if split else (gate_up, down)
    x = torch.randn(3, hidden, generator=g).to(dtype)
    got = native.gated_expert(rowmm, _Math, views, x, None if dtype == torch.float32 else dtype)
    xf = x.double()
    gate, up = (xf @ gate_up.double().T).chunk(2, dim=-1)
    h = F.silu(gate) * up
    if dtype != torch.float32:
        h = h.float().to(dtype).double()
    ref = h @ down.double().T
    assert got.dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 2e-2             # bf16: one activation rounding apart
    assert (got.double() - ref).abs().max().item() <= tol * ref.abs().max().item()


def test_eligible_reads_the_layout():
    from k3client.hf.families import Standard
    from k3client.layout import build_layout

    fam = Standard({"gate_proj.weight", "up_proj.weight", "down_proj.weight"})

    def specs(dtype, inter):
        return build_layout([("gate_proj.weight", dtype, (inter, 64), 0), ("up_proj.weight", dtype, (inter, 64), 0),
                             ("down_proj.weight", dtype, (64, inter), 0)])

    assert native.eligible(specs("BF16", 32), fam)
    assert not native.eligible(specs("F16", 32), fam)            # rowmm reads bf16 only
    assert not native.eligible(specs("BF16", 40), fam)           # down's K = inter, not a multiple of 16
