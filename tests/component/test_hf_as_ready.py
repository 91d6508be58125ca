"""Component: ``k3client.hf`` computes a layer's experts in the order they arrive, logits still eager's.

The real server loop serves a tiny Qwen3-MoE checkpoint (written by transformers'
``save_pretrained``) from a source whose reads of the first MoE layer's low experts
wait at a gate.  The high experts are made resident first, so the layer's fetch
gets them in its first part; the gate opens when the runtime takes its first
expert, so the low ones arrive after it, out of ascending order.  The runtime
must have computed them in that order and still sum them in eager's order:
the logits equal ``experts_implementation="eager"`` bit for bit.
"""

import shutil
import tempfile
import threading

import pytest

from conftest import SCRATCH
from k3d.config import resolve
from k3d.memory.arena import Arena
from k3d.serve.loop import Server
from k3d.service.daemon import size_arena
from k3d.sources.digest import for_source
from k3d.sources.safetensors import SafetensorsSource

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5")


class Gated(SafetensorsSource):
    """The real source; reads of ``held`` keys wait until ``gate`` is set."""

    def __init__(self, *a):
        super().__init__(*a)
        self.held, self.gate = set(), threading.Event()

    def read(self, extents, slot):
        key = self._key(extents[0]) if self.held else None
        if key in self.held:
            self.gate.wait(30)
        return super().read(extents, slot)

    def _key(self, extent):
        for key, exts in self.keys.items():
            if any(e.file == extent.file and e.offset <= extent.offset < e.offset + e.length for e in exts):
                return key
        return None


def test_experts_computed_as_they_arrive_keep_eager_logits():
    from transformers import AutoModelForCausalLM

    import k3client
    from k3client.hf import load_model
    from k3d.demo import hf_models

    tmp = tempfile.mkdtemp(prefix="k3d-c-", dir=SCRATCH)
    # top-4: with three or more experts per token the summation order changes the bits
    path = hf_models.write("qwen3_moe", f"{tmp}/model", fields={"num_experts_per_tok": 4})
    cfg = resolve({"source": path, "endpoint": f"ipc://{tmp}/k.sock", "slots": 64, "readers": 2,
                   "state_dir": "none", "predict": "client"}, {})
    src = Gated(path, cfg.pattern)
    src.digest = for_source(src, "", 2)      # (the daemon computes it at start: load_model verifies it)
    n, sb = size_arena(cfg, src.expert_bytes)
    arena = Arena(n, sb)
    srv = Server(cfg, src, arena, f"{tmp}/k.sock.arena")
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    model = None
    try:
        layer = min(l for l, _ in src.keys)
        experts = sorted(e for l, e in src.keys if l == layer)
        low, high = experts[:len(experts) // 2], experts[len(experts) // 2:]
        with k3client.connect(cfg.endpoint, name="warm") as w:
            w.fetch(layer, high)                  # resident, unpinned once it leaves
        src.held = {(layer, e) for e in low}
        model = load_model(path, endpoint=cfg.endpoint, dtype=torch.bfloat16, predict=False)
        order = []
        views = model.k3d._views

        def recorded(ml, ex):
            if ml.layer == layer:
                order.append(ex.expert)
                src.gate.set()                    # the low experts' reads go on from here
            return views(ml, ex)

        model.k3d._views = recorded
        ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(1))
        ref = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager", dtype=torch.bfloat16)
        with torch.no_grad():
            a, b = ref(ids).logits, model(ids).logits
        routed_low = [e for e in order if e in low]
        assert routed_low and order[0] in high, order          # resident first, then the reads
        assert order != sorted(order)                          # so computed out of ascending order
        assert torch.equal(a, b), f"max |diff| {(a.float() - b.float()).abs().max().item()}"
    finally:
        src.gate.set()
        if model is not None:
            model.k3d.client.close()
        srv.request_stop()
        t.join(10)
        arena.close()
        src.close()
        shutil.rmtree(tmp, ignore_errors=True)
