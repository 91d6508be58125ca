"""Component: the runtime's grouped fetches and views against the real server loop.

A tiny gated checkpoint (gate/up/down per expert, written by ``safetensors.torch``) is
served by the real server loop on an ipc socket with an arena of 3 slots; a real client's
``Runtime`` fetches one layer's 8 experts.  The groups must be as large as the arena
allows, a new epoch must start before a group that would not fit beside the epoch's
pins, and another client's pins must shrink the groups (``CacheFull``, halved) rather
than fail the layer.  Each group's views are the views rule's: gate and up back to back
in the slot come as one view, equal to the checkpoint's tensors.
"""

import shutil
import tempfile

import pytest

from conftest import SCRATCH
from k3d.config import DEFAULT_PATTERN
from servers import Servers

torch = pytest.importorskip("torch")

LAYERS, EXPERTS, H, I = 2, 8, 64, 32
NAMES = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")


def _write(path: str) -> dict:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(3)
    tensors = {}
    for layer in range(LAYERS):
        for e in range(EXPERTS):
            for name, shape in zip(NAMES, ((I, H), (I, H), (H, I))):
                key = DEFAULT_PATTERN.format(layer=layer, expert=e, name=name)
                tensors[key] = torch.randn(*shape, generator=g).to(torch.float16)
    save_file(tensors, f"{path}/model.safetensors")
    return tensors


@pytest.fixture
def served():
    ckpt = tempfile.mkdtemp(prefix="k3d-c-", dir=SCRATCH)
    tensors = _write(ckpt)
    servers = Servers(ckpt)
    try:
        yield servers.start(slots=3).cfg.endpoint, tensors
    finally:
        servers.close()
        shutil.rmtree(ckpt, ignore_errors=True)


def _runtime(client):
    from k3client.runtime import Layer, Runtime, Standard

    specs = client.layout_of(0)
    ml = Layer(0, None, None, Standard({s.name for s in specs}), tuple(s.name for s in specs), torch.float16,
               specs=specs)
    return Runtime(client, {0: ml}, predict=False), ml


@pytest.mark.parametrize("as_ready", [False, True])
def test_groups_fill_the_arena_and_a_new_epoch_starts_before_one_that_would_not_fit(served, as_ready):
    import k3client

    endpoint, tensors = served
    with k3client.connect(endpoint, name="groups") as c:
        rt, ml = _runtime(c)
        assert ml.fused                                   # down, gate, up: gate and up adjacent
        rt.begin_forward()
        plan = []
        for group in rt._groups(ml, list(range(EXPERTS)), None, as_ready=as_ready):
            got = list(group)
            plan.append(sorted(e for e, _ in got))
            for e, views in got:                          # read between the fetch and the next epoch
                gate_up, down = views
                key = DEFAULT_PATTERN.format(layer=0, expert=e, name="{}")
                want = torch.cat([tensors[key.format("gate_proj.weight")], tensors[key.format("up_proj.weight")]])
                assert torch.equal(gate_up, want) and torch.equal(down, tensors[key.format("down_proj.weight")])
        assert plan == [[0, 1, 2], [3, 4, 5], [6, 7]]
        assert (rt.stats.epochs, rt.stats.fetches, rt.held, rt.stats.cache_full_retries) == (3, 3, 2, 0)


def test_other_clients_pins_halve_the_groups_instead_of_failing(served):
    import k3client

    endpoint, _ = served
    with k3client.connect(endpoint, name="other") as other, k3client.connect(endpoint, name="groups") as c:
        other.fetch(1, [6, 7])                            # pinned until its next begin_token: 1 slot left
        rt, ml = _runtime(c)
        rt.begin_forward()
        plan = [[e for e, _ in group] for group in rt._groups(ml, list(range(EXPERTS)), None)]
        assert plan == [[e] for e in range(EXPERTS)]      # 3 refused, halved to 1, one per epoch
        assert rt.stats.cache_full_retries == 1 and rt.stats.epochs == EXPERTS
