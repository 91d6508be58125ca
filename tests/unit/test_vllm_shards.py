"""k3client.vllm.ranks: a rank's tensor-parallel shard of an expert and its expert-parallel experts.

The mapping is integers (vLLM's even split of the intermediate size; its "linear" and
"round_robin" expert placements); the shards are checked by what they must add up to:
the ranks' partial outputs, summed as vLLM's all-reduce sums them, equal the whole
expert's output (float64), and every shard is a view of the whole, never a copy.
"""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from k3client.vllm import ranks

torch = pytest.importorskip("torch")
F = torch.nn.functional


def test_span_is_vllms_even_split():
    assert [ranks.Shard(r, 2).span(256) for r in range(2)] == [(0, 128), (128, 256)]
    assert [ranks.Shard(r, 4).span(32) for r in range(4)] == [(0, 8), (8, 16), (16, 24), (24, 32)]
    with pytest.raises(ValueError, match="does not split over 3 tensor-parallel ranks"):
        ranks.Shard(0, 3).span(32)
    with pytest.raises(ValueError, match="rank 2 outside"):
        ranks.Shard(2, 2)


def test_expert_map_linear_and_round_robin():
    # vLLM's determine_expert_map: 10 experts over 4 ranks, the first 10 % 4 ranks one more
    assert ranks.expert_map(10, 4, 0) == [0, 1, 2, -1, -1, -1, -1, -1, -1, -1]
    assert ranks.expert_map(10, 4, 1) == [-1, -1, -1, 0, 1, 2, -1, -1, -1, -1]
    assert ranks.expert_map(10, 4, 3) == [-1] * 8 + [0, 1]
    assert ranks.expert_map(10, 4, 1, "round_robin") == [-1, 0, -1, -1, -1, 1, -1, -1, -1, 2]
    assert ranks.owned(ranks.expert_map(10, 4, 2)) == {6, 7}
    with pytest.raises(ValueError, match="placement 'random'"):
        ranks.expert_map(10, 4, 0, "random")
    with pytest.raises(ValueError, match="rank 4 outside"):
        ranks.expert_map(10, 4, 4)


@given(st.integers(1, 300), st.integers(1, 16), st.sampled_from(["linear", "round_robin"]))
def test_every_expert_on_exactly_one_rank(experts, size, strategy):
    maps = [ranks.expert_map(experts, size, r, strategy) for r in range(size)]
    owners = [[r for r in range(size) if maps[r][g] >= 0] for g in range(experts)]
    assert all(len(o) == 1 for o in owners)
    for m in maps:                      # local ids are 0..local-1, in global order
        local = [x for x in m if x >= 0]
        assert local == list(range(len(local)))
        assert len(local) in (experts // size, experts // size + 1)


def test_ep_refusal_names_vllm_on_cpu_only():
    assert ranks.ep_refusal("cpu", True).startswith("vLLM 0.32's CPU build cannot run expert parallelism")
    assert ranks.ep_refusal("cpu", False) is None
    assert ranks.ep_refusal("cuda", True) is None


def _views_of(*shapes, g):
    """Tensors laid back to back in one buffer (as an arena slot holds an expert), as views."""
    sizes = [torch.Size(sh).numel() for sh in shapes]
    buf = torch.randn(sum(sizes), generator=g, dtype=torch.float64)
    out, at = [], 0
    for shape, n in zip(shapes, sizes):
        out.append(buf[at:at + n].view(shape))
        at += n
    return buf, out


def _shares(buf, t):
    return t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gated_shards_sum_to_the_whole_expert(fused, tp):
    g = torch.Generator().manual_seed(tp)
    H, inter = 16, 32
    x = torch.randn(3, H, generator=g, dtype=torch.float64)
    buf, (gate, up, down) = _views_of((inter, H), (inter, H), (H, inter), g=g)
    whole = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
    views = (buf[:2 * inter * H].view(2 * inter, H), down) if fused else (gate, up, down)
    total = torch.zeros_like(whole)
    for r in range(tp):
        sg, su, sd = ranks.Shard(r, tp).gated(views)
        a, b = r * inter // tp, (r + 1) * inter // tp
        # vLLM's loader: gate (w1) and up (w3) rows [a, b), down (w2) columns [a, b)
        assert torch.equal(sg, gate[a:b]) and torch.equal(su, up[a:b]) and torch.equal(sd, down[:, a:b])
        assert all(_shares(buf, t) for t in (sg, su, sd))
        assert sd.stride() == (inter, 1)             # the down shard: a strided view, no copy
        total += F.linear(F.silu(F.linear(x, sg)) * F.linear(x, su), sd)
    torch.testing.assert_close(total, whole, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gpt_oss_shards_sum_to_the_whole_expert(tp):
    """Interleaved gate/up columns stay in pairs; the down bias is added once (rank 0)."""
    g = torch.Generator().manual_seed(10 + tp)
    H, inter = 16, 32
    x = torch.randn(3, H, generator=g, dtype=torch.float64)
    buf, (gu, gub, dn, dnb) = _views_of((H, 2 * inter), (2 * inter,), (inter, H), (H,), g=g)
    views = {"gate_up_proj": gu, "gate_up_proj_bias": gub, "down_proj": dn, "down_proj_bias": dnb}

    def expert(w):
        y = torch.addmm(w["gate_up_proj_bias"], x, w["gate_up_proj"])
        gate, up = y[..., ::2].clamp(max=7.0), y[..., 1::2].clamp(-7.0, 7.0)
        h = (up + 1) * gate * torch.sigmoid(1.702 * gate)
        out = h @ w["down_proj"]
        return out + w["down_proj_bias"] if "down_proj_bias" in w else out

    total = torch.zeros(3, H, dtype=torch.float64)
    for r in range(tp):
        s = ranks.Shard(r, tp).gpt_oss(views)
        assert ("down_proj_bias" in s) == (r == 0)
        assert all(_shares(buf, t) for t in s.values())
        total += expert(s)
    torch.testing.assert_close(total, expert(views), rtol=1e-12, atol=1e-12)


def test_native_rowmm_reads_a_down_shard_in_place():
    """The down shard's columns, a strided bf16 view, through ``native.rowmm`` with no copy."""
    from k3client.vllm import native

    op = native.load()
    if op is None:
        pytest.skip("native expert kernel unavailable here (no AVX-512 or no compiler; see the log)")
    g = torch.Generator().manual_seed(3)
    H, inter = 32, 64
    down = torch.randn(H, inter, generator=g).to(torch.bfloat16)
    h = torch.randn(2, inter // 2, generator=g)
    for r in range(2):
        sd = ranks.Shard(r, 2).gated((down, down, down))[2]
        want = h.double() @ sd.double().T
        torch.testing.assert_close(op(h, sd).double(), want, rtol=1e-5, atol=1e-5)


def test_native_eligible_checks_the_shards_width():
    from types import SimpleNamespace as NS

    from k3client.hf.families import Standard

    fam = Standard({"w1.weight", "w3.weight", "w2.weight"})

    def specs(inter):
        return [NS(name="w1.weight", dtype="BF16", shape=(inter, 64)),
                NS(name="w3.weight", dtype="BF16", shape=(inter, 64)),
                NS(name="w2.weight", dtype="BF16", shape=(64, inter))]

    from k3client.vllm import native

    assert native.eligible(specs(32), fam, 2)
    assert not native.eligible(specs(32), fam, 4)           # 8 columns per rank: not a multiple of 16
    assert native.eligible(specs(64), fam, 4)
