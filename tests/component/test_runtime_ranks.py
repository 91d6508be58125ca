"""Component: ranks of a multi-rank engine, each a client of the real server loop, add up to one rank.

A tiny gated checkpoint (gate/up/down per expert, ``safetensors.torch``) is served by the
real server loop on an ipc socket.  One layer call (vLLM's numerics, ``compute.fused``,
float32, 5 tokens x top-2) is computed by a single whole-expert runtime, then by two
"ranks", each its own client with its own runtime, as vLLM's tensor-parallel ranks
(``Layer.shard``: a slice of every expert) and as its expert-parallel ranks
(``Layer.mine``: vLLM's linear expert map).  What vLLM's all-reduce makes of the ranks'
outputs, their sum, equals the single rank's output; the second tensor-parallel rank
finds every expert resident (the first rank's misses loaded them: hits only), and an
expert-parallel rank fetches only its own experts.
"""

import shutil
import tempfile

import pytest

from conftest import SCRATCH
from k3d.config import DEFAULT_PATTERN
from servers import Servers

torch = pytest.importorskip("torch")

EXPERTS, H, I, TOKENS, TOP_K = 8, 64, 32, 5, 2
NAMES = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")


@pytest.fixture(scope="module")
def endpoint():
    from safetensors.torch import save_file

    ckpt = tempfile.mkdtemp(prefix="k3d-c-", dir=SCRATCH)
    g = torch.Generator().manual_seed(5)
    tensors = {DEFAULT_PATTERN.format(layer=0, expert=e, name=n): torch.randn(*shape, generator=g).to(torch.float16)
               for e in range(EXPERTS) for n, shape in zip(NAMES, ((I, H), (I, H), (H, I)))}
    save_file(tensors, f"{ckpt}/model.safetensors")
    servers = Servers(ckpt)
    try:
        yield servers.start(slots=2 * EXPERTS).cfg.endpoint
    finally:
        servers.close()
        shutil.rmtree(ckpt, ignore_errors=True)


def _step():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(TOKENS, H, generator=g)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(TOKENS)])
    return x, ids, torch.rand(TOKENS, TOP_K, generator=g)


def _layer_call(endpoint, name, shard=None, mine=None):
    """One runtime of its own client computes the step's layer: (output, stats, the daemon's stats after)."""
    import k3client
    from k3client.runtime import Activation, Layer, Runtime, Standard

    x, ids, w = _step()
    with k3client.connect(endpoint, name=name) as c:
        specs = c.layout_of(0)
        ml = Layer(0, Activation(EXPERTS, "silu"), None, Standard({s.name for s in specs}),
                   tuple(s.name for s in specs), torch.float32, specs=specs, shard=shard, mine=mine)
        rt = Runtime(c, {0: ml}, predict=False, numerics="fused")
        rt.begin_forward()
        out = rt.run_layer(ml, x, ids, w)
        return out, rt.stats, c.status()["stats"]


def test_tensor_parallel_ranks_sum_to_the_whole_experts(endpoint):
    from k3client.vllm.ranks import Shard

    whole, _, _ = _layer_call(endpoint, "whole")
    parts, daemon = [], []
    for r in range(2):
        out, st, ds = _layer_call(endpoint, f"rank-tp{r}", shard=Shard(r, 2))
        parts.append(out)
        daemon.append(ds)
        assert st.experts_fetched == len(set(_step()[1].reshape(-1).tolist()))   # every routed expert
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(parts[0], whole, rtol=1e-3, atol=1e-3)          # a shard is not the whole
    assert daemon[1]["misses"] == daemon[0]["misses"]                         # rank 1: all hits


def test_expert_parallel_ranks_compute_their_own_experts(endpoint):
    from k3client.vllm.ranks import expert_map, owned

    whole, _, _ = _layer_call(endpoint, "whole")
    routed = set(_step()[1].reshape(-1).tolist())
    total = torch.zeros_like(whole)
    for r in range(2):
        mine = owned(expert_map(EXPERTS, 2, r))
        out, st, _ = _layer_call(endpoint, f"rank-ep{r}", mine=mine)
        assert st.experts_fetched == len(routed & mine)
        total += out
    torch.testing.assert_close(total, whole, rtol=1e-4, atol=1e-4)
