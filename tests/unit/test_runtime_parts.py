"""Unit: the runtime's pure pieces (k3client.runtime): the ordered sum, the views rule's layout
test, gate-ahead's reading of a router's output, and the numerics a runtime accepts."""

import os
import subprocess
import sys

import pytest

from helpers import ROOT

torch = pytest.importorskip("torch")

from k3client.layout import build_layout  # noqa: E402
from k3client.runtime import Standard  # noqa: E402
from k3client.runtime.compute import InOrder  # noqa: E402
from k3client.runtime.families import GptOss  # noqa: E402
from k3client.runtime.gate_ahead import expert_indices, picks  # noqa: E402
from k3client.runtime.layer import back_to_back  # noqa: E402

# float32 values whose sum depends on its order: 1e8 + 1 rounds back to 1e8
BIG, ONE = 1e8, 1.0


def _one(v):
    return torch.tensor([[v]], dtype=torch.float32)


@pytest.mark.parametrize("arrival", [(0, 1, 2), (2, 0, 1), (1, 2, 0), (2, 1, 0)])
def test_in_order_sums_in_the_experts_order_whatever_the_arrival(arrival):
    outputs = {0: BIG, 1: ONE, 2: -BIG}
    out = torch.zeros(1, 1)
    acc = InOrder(out, [0, 1, 2])
    row = torch.tensor([0])
    for e in arrival:
        acc.add(e, row, _one(outputs[e]))
    # ascending: (1e8 + 1) - 1e8 == 0 in float32; arrival (2, 0, 1) alone would give 1
    assert out.item() == 0.0
    assert acc.next == 3 and not acc.held


def test_in_order_holds_an_output_while_an_earlier_expert_is_missing():
    out = torch.zeros(2, 1)
    acc = InOrder(out, [3, 5, 9])
    acc.add(9, torch.tensor([1]), _one(2.0))
    acc.add(5, torch.tensor([0]), _one(1.0))
    assert out.sum().item() == 0.0 and set(acc.held) == {5, 9}     # 3 not here: nothing added
    acc.add(3, torch.tensor([1]), _one(4.0))
    assert out.flatten().tolist() == [1.0, 6.0] and not acc.held


def test_in_order_casts_to_the_output_dtype():
    out = torch.zeros(1, 2, dtype=torch.bfloat16)
    acc = InOrder(out, [0])
    acc.add(0, torch.tensor([0]), torch.tensor([[1.5, 2.25]], dtype=torch.float32))
    assert out.dtype == torch.bfloat16 and out.float().tolist() == [[1.5, 2.25]]


def test_gate_and_up_back_to_back_make_one_view():
    # sorted layout order: down, gate, up: gate and up adjacent
    fam = Standard({"gate_proj.weight", "up_proj.weight", "down_proj.weight"})
    specs = build_layout([("gate_proj.weight", "BF16", (32, 64), 32 * 64 * 2),
                          ("up_proj.weight", "BF16", (32, 64), 32 * 64 * 2),
                          ("down_proj.weight", "BF16", (64, 32), 64 * 32 * 2)])
    assert back_to_back(specs, fam)
    mixed = build_layout([("gate_proj.weight", "BF16", (32, 64), 32 * 64 * 2),
                          ("up_proj.weight", "F32", (32, 64), 32 * 64 * 4),
                          ("down_proj.weight", "BF16", (64, 32), 64 * 32 * 2)])
    assert not back_to_back(mixed, fam)                              # one view needs one dtype


def test_split_gate_and_up_stay_two_views():
    # w1, w2, w3 in layout order: down (w2) lies between gate (w1) and up (w3)
    fam = Standard({"w1.weight", "w2.weight", "w3.weight"})
    specs = build_layout([("w1.weight", "BF16", (32, 64), 32 * 64 * 2), ("w3.weight", "BF16", (32, 64), 32 * 64 * 2),
                          ("w2.weight", "BF16", (64, 32), 64 * 32 * 2)])
    assert not back_to_back(specs, fam)


def test_fused_and_gpt_oss_layouts_have_no_halves_to_join():
    fused = Standard({"input_linear.weight", "output_linear.weight"})
    assert not back_to_back(build_layout([("input_linear.weight", "BF16", (64, 64), 8192),
                                          ("output_linear.weight", "BF16", (64, 32), 4096)]), fused)
    oss = GptOss(set(GptOss.NAMES))
    assert not back_to_back(build_layout([(n, "BF16", (4, 4), 32) for n in GptOss.NAMES]), oss)


def test_router_indices_are_its_one_integer_tensor():
    logits, idx = torch.randn(3, 8), torch.tensor([[1, 4], [0, 7], [4, 2]])
    assert expert_indices((logits, torch.softmax(logits, -1), idx)) is idx       # (logits, scores, indices)
    assert expert_indices((idx, torch.rand(3, 2), logits)) is idx                # (indices, weights, logits)
    assert expert_indices(logits) is None                                        # logits only: no guess
    assert expert_indices((idx, idx.clone())) is None                            # two: ambiguous


def test_router_logits_give_their_top_k():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0], [5.0, 0.0, 4.0, 1.0]])
    assert sorted(picks(logits, 2)[0].tolist()) == [1, 3]
    assert sorted(picks((logits, None), 2)[1].tolist()) == [0, 2]              # vLLM's gate: (logits, bias)
    assert picks(logits, 9).shape == (2, 4)                                      # top_k capped at the experts
    idx = torch.tensor([[2, 0]])
    assert picks((torch.randn(1, 4), idx), None) is idx


def test_numerics_are_named():
    from k3client.runtime import Runtime

    class NoClient:
        restarts, before_unmap = 0, []

    with pytest.raises(ValueError, match="numerics 'exact'"):
        Runtime(NoClient(), {}, numerics="exact")


def test_the_runtime_imports_no_engine_and_no_adapter():
    code = ("import sys, k3client.runtime\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'vllm')\n"
            "             or m.startswith(('k3client.hf', 'k3client.vllm')))\n"
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
