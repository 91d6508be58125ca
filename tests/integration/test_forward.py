"""A real forward pass: one MoE FFN layer (top-k routing, SwiGLU over w1/w3/w2) on CPU with torch,
from experts served by the real daemon, equal to the same layer computed from the checkpoint read
directly by the safetensors / gguf libraries.

The served side decodes with ``k3client.mxfp4``; the GGUF reference decodes with ``gguf.quants``, so
equal outputs also mean the two dequantizers agree bit for bit on real weights.
"""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T, GGUFReader
from gguf.quants import dequantize as gguf_dequantize

import k3client
from helpers import k3d, reference
from k3client.mxfp4 import dequantize
from k3d.demo.synthetic import write_synthetic_gguf

# torch is optional for k3d; the test extra installs it (the CPU build, via the README's index)
torch = pytest.importorskip("torch", reason="needs torch; CPU build: "
                            "pip install torch --index-url https://download.pytorch.org/whl/cpu")
F = torch.nn.functional

TOP_K = 4


def moe_ffn(x, router_w, weights):
    """y = sum over the top-k experts of gate * w2 @ (silu(w1 @ x) * (w3 @ x)); ``weights(e)`` -> (w1, w3, w2)."""
    top, idx = torch.topk(x @ router_w.T, TOP_K, dim=-1)
    gates = torch.softmax(top, dim=-1)
    out = torch.zeros_like(x)
    for e in sorted(set(idx.flatten().tolist())):
        tok, k = (idx == e).nonzero(as_tuple=True)
        w1, w3, w2 = weights(e)
        h = F.silu(x[tok] @ w1.T) * (x[tok] @ w3.T)
        out.index_add_(0, tok, (h @ w2.T) * gates[tok, k, None])
    return out, sorted(set(idx.flatten().tolist()))


def tokens(hidden, n=24, seed=0):
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((n, hidden)).astype(np.float32) * 0.05)


def served(client, layer, experts, decode):
    client.begin_token()
    got = {ex.expert: ex for ex in client.fetch(layer, experts)}
    return lambda e: decode(got[e])


def test_safetensors_ocp_layer(checkpoint, start_daemon):
    d = start_daemon(checkpoint, "--arena", "8MiB")
    st = reference(checkpoint, "pt")

    def ref_weights(layer):
        def w(e):
            return tuple(dequantize(st.expert(layer, e, f"{m}.weight_packed"), st.expert(layer, e, f"{m}.weight_scale"),
                                    name=m) for m in ("w1", "w3", "w2"))
        return w

    def decode(ex):
        return tuple(dequantize(ex.tensor(f"{m}.weight_packed"), ex.tensor(f"{m}.weight_scale"), name=m)
                     for m in ("w1", "w3", "w2"))

    with k3client.connect(d.endpoint, name="forward") as c:
        for layer in (0, 3):
            router = st(f"model.layers.{layer}.mlp.router.weight").float()
            x = tokens(router.shape[1], seed=layer)
            ref, used = moe_ffn(x, router, ref_weights(layer))
            out, used2 = moe_ffn(x, router, served(c, layer, used, decode))
            assert used == used2 and len(used) > TOP_K
            assert torch.isfinite(ref).all() and ref.abs().max() > 0
            assert torch.equal(out, ref)
    assert d.stop() == 0


def _gguf_reference(path):
    r = GGUFReader(path)
    by = {t.name: t for t in r.tensors}

    def weights(layer):
        def w(e):
            out = []
            for part in ("gate", "up", "down"):
                t = by[f"blk.{layer}.ffn_{part}_exps.weight"]
                out.append(torch.from_numpy(np.array(gguf_dequantize(t.data[e], t.tensor_type), np.float32)))
            return tuple(out)
        return w

    return by, weights


def _ggml_decode(ex, types):
    out = []
    for part in ("gate", "up", "down"):
        name = f"ffn_{part}_exps.weight"
        fmt = types[name]
        if fmt == "ggml:MXFP4":
            out.append(dequantize(ex.tensor(name), layout="ggml", name=name))
        elif fmt in ("ggml:F16", "ggml:F32"):
            out.append(ex.tensor(name).float())
        else:   # other block types: the gguf library decodes the served bytes
            out.append(torch.from_numpy(gguf_dequantize(ex.array(name), T[fmt.split(":")[1]])))
    return tuple(out)


@pytest.mark.parametrize("types,packed", [(("MXFP4",) * 3, False), (("MXFP4", "Q8_0", "F16"), True)])
def test_gguf_layer(tmp_path, start_daemon, types, packed):
    path = write_synthetic_gguf(str(tmp_path / "m.gguf"), layers=2, experts=16, hidden=256, inter=128,
                                types=types, seed=11)
    by, ref_weights = _gguf_reference(path)
    source, args = path, []
    if packed:
        source = str(tmp_path / "m.k3pack")
        r = k3d("pack", path, source, "--no-progress")
        assert r.returncode == 0, r.stderr
        args = ["--read-mode", "direct"]
    d = start_daemon(source, "--arena", "8MiB", *args)
    with k3client.connect(d.endpoint, name="forward-gguf") as c:
        ttypes = c.model["tensor_types"]
        assert ttypes["ffn_gate_exps.weight"] == "ggml:MXFP4"
        for layer in range(2):
            router = torch.from_numpy(np.array(by[f"blk.{layer}.ffn_gate_inp.weight"].data, np.float32))
            x = tokens(256, seed=10 + layer)
            ref, used = moe_ffn(x, router, ref_weights(layer))
            out, _ = moe_ffn(x, router, served(c, layer, used, lambda ex: _ggml_decode(ex, ttypes)))
            assert torch.isfinite(ref).all() and ref.abs().max() > 0
            assert torch.equal(out, ref)
    assert d.stop() == 0
