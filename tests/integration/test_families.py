"""Integration: every MoE family as transformers' own save_pretrained writes it is served without a pattern.

For each family a tiny model is saved (CPU, float32), opened with no ``--pattern``,
and every byte of every served expert is compared with ``safe_open``'s tensor (per-
expert families) or its ``[e]`` slice (stacked ones; DBRX's 2-D ``[E*I, H]`` reshaped
to ``[E, I, H]``).  Where experts live is stated by ``tests/tiny_families.EXPECTED``,
independently of ``k3d.sources.families``.
"""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("transformers")
from safetensors import safe_open
from safetensors.numpy import save_file

import k3client
from helpers import k3ctl
from k3client import mxfp4
from k3d.sources import SourceError, open_source
from k3d.sources.safetensors import SafetensorsSource
from tests import tiny_families as tf

FAMILIES = sorted(tf.EXPECTED)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """model_type -> directory, each written once per module."""
    root = tmp_path_factory.mktemp("families")
    cache = {}

    def get(mt):
        if mt not in cache:
            cache[mt] = tf.write(mt, str(root / mt))
        return cache[mt]
    return get


def _config(path) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def _reference(path):
    """name -> numpy array of every tensor in the checkpoint (safe_open, the reference reader)."""
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "np") as s:
                for k in s.keys():  # noqa: SIM118 (safe_open is not iterable)
                    out[k] = s.get_tensor(k)
    return out


def _expected(mt, ref):
    """{(layer, expert): {layout name: reference array}} from EXPECTED and the names alone."""
    template, kind, layers = tf.EXPECTED[mt]
    want = {}
    for layer in layers:
        if kind == "per-expert":
            pre = template.format(l=layer, e="{e}")
            rx = re.compile(re.escape(pre).replace(re.escape("{e}"), r"(\d+)") + r"(.+)\Z")
            for name, arr in ref.items():
                m = rx.match(name)
                if m:
                    want.setdefault((layer, int(m[1])), {})[m[2]] = arr
        else:
            pre = template.format(l=layer)
            for name in tf.STACKED_NAMES[mt]:
                arr = ref[pre + name]
                if kind == "flat":
                    arr = arr.reshape(tf.E, -1, arr.shape[-1])
                assert arr.shape[0] == tf.E
                for e in range(tf.E):
                    want.setdefault((layer, e), {})[name] = arr[e]
    return want


@pytest.mark.parametrize("mt", FAMILIES)
def test_family_served_byte_for_byte(saved, mt):
    path = saved(mt)
    ref = _reference(path)
    want = _expected(mt, ref)
    src = open_source(path, None)
    try:
        d = src.describe()
        assert d["family"] == tf.FAMILY_NAME.get(mt, mt)
        assert "config.json model_type" in d["family_rule"]
        assert d["layers"] == tf.EXPECTED[mt][2]
        assert set(src.keys) == set(want), "served experts differ from the routed experts on disk"
        assert d["experts_per_layer"] == tf.E
        assert d["top_k"] == (1 if mt.startswith("llama4") else tf.TOP_K)
        slot = bytearray(src.expert_bytes)
        for key in sorted(want):
            layout = src.layout_of(key[0])
            assert {s.name for s in layout} == set(want[key]), key
            slot[:] = bytes(len(slot))
            src.read(src.keys[key], memoryview(slot))
            for spec in layout:
                arr = np.ascontiguousarray(want[key][spec.name])
                assert tuple(spec.shape) == arr.shape, (key, spec.name)
                assert bytes(slot[spec.offset:spec.offset + spec.nbytes]) == arr.tobytes(), (key, spec.name)
    finally:
        src.close()


@pytest.mark.parametrize("mt", ["mixtral", "gpt_oss", "granitemoe"])
def test_names_alone_find_the_family(saved, mt, tmp_path):
    """Without config.json the tensor names settle the storage rule (DBRX needs its config)."""
    src_dir = saved(mt)
    for f in os.listdir(src_dir):
        if f.endswith(".safetensors"):
            os.symlink(os.path.join(src_dir, f), tmp_path / f)
    src = SafetensorsSource(str(tmp_path))
    try:
        d = src.describe()
        assert d["family"] == {"mixtral": "experts.block_sparse_moe", "gpt_oss": "stacked.mlp",
                               "granitemoe": "stacked.block_sparse_moe"}[mt]
        assert d["family_rule"].endswith("(tensor names)") and len(src.keys) == 2 * tf.E
    finally:
        src.close()


def test_config_that_disagrees_is_one_line(saved, tmp_path):
    src_dir = saved("mixtral")
    for f in os.listdir(src_dir):
        if f.endswith(".safetensors"):
            os.symlink(os.path.join(src_dir, f), tmp_path / f)
    cfg = _config(src_dir)
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, num_local_experts=8)))
    with pytest.raises(SourceError, match=r"config.json says 8 experts per layer, but in layer 0 it has 4 "
                                          r"experts \(0-3\)"):
        SafetensorsSource(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, model_type="gpt_oss")))
    with pytest.raises(SourceError, match=r"config.json says model_type 'gpt_oss' .* its tensors match rule "
                                          r"experts.block_sparse_moe \('model.layers.0.block_sparse_moe"):
        SafetensorsSource(str(tmp_path))


def test_stacked_first_dimension_must_be_the_expert_count(saved, tmp_path):
    src_dir = saved("gpt_oss")
    for f in os.listdir(src_dir):
        if f.endswith(".safetensors"):
            os.symlink(os.path.join(src_dir, f), tmp_path / f)
    cfg = _config(src_dir)
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, num_local_experts=3)))
    with pytest.raises(SourceError, match=r"stacked expert tensor 'model.layers.0.mlp.experts.down_proj' is "
                                          r"\[4, \d+, \d+\]: its first dimension is not the config.json's 3 experts"):
        SafetensorsSource(str(tmp_path))
    dbrx = saved("dbrx")
    for f in os.listdir(dbrx):
        if f.endswith(".safetensors"):
            os.symlink(os.path.join(dbrx, f), tmp_path / ("d-" + f))
    cfg = _config(dbrx)
    cfg["ffn_config"]["moe_num_experts"] = 3
    os.makedirs(tmp_path / "d")
    os.rename(tmp_path / ("d-model.safetensors"), tmp_path / "d" / "model.safetensors")
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SourceError, match=r"tensor 'transformer.blocks.0.ffn.experts.mlp.v1' is \[64, 32\]: its "
                                          r"first dimension does not divide by the config.json's 3 experts"):
        SafetensorsSource(str(tmp_path / "d"))


@pytest.mark.parametrize("mt", ["gpt_oss", "jamba"])
def test_start_serves_the_family_without_a_pattern(saved, mt, start_daemon):
    """`k3d start --source DIR` with no --pattern: hello and status report the family and the layers served."""
    path = saved(mt)
    want = _expected(mt, _reference(path))
    d = start_daemon(path, "--slots", "8")
    with k3client.connect(d.endpoint, name=mt) as c:
        for m in (c.model, c.status()["model"]):
            assert m["family"] == mt and m["layers"] == tf.EXPECTED[mt][2]
        for layer in tf.EXPECTED[mt][2]:
            c.begin_token()
            for ex in c.fetch(layer, [3, 1]):
                for spec in c.layout_of(layer):
                    assert ex.array(spec.name).tobytes() == np.ascontiguousarray(
                        want[(layer, ex.expert)][spec.name]).tobytes()
    r = k3ctl("status", "--endpoint", d.endpoint)
    layers = {"gpt_oss": "layers 0-1", "jamba": "layers 1,3"}[mt]
    assert r.returncode == 0 and f": {mt} {2 * tf.E} experts, {layers}" in r.stdout, r.stdout
    assert d.stop() == 0


def _k3d(*args):
    return subprocess.run([sys.executable, "-m", "k3d", *args], capture_output=True, text=True, timeout=120)


def test_inspect_describes_without_starting(saved):
    path = saved("deepseek_v3")
    r = _k3d("inspect", path, "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["family"] == "deepseek_v3" and info["rule"].startswith("experts.mlp (config.json")
    assert info["layers"] == [1, 2] and info["experts_per_layer"] == tf.E and info["top_k"] == tf.TOP_K
    names = {t["name"] for t in info["layouts"][0]["tensors"]}
    assert names == {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}
    one = _expected("deepseek_v3", _reference(path))[(1, 0)]
    per_expert = sum(np.ascontiguousarray(a).nbytes for a in one.values())     # 2 KiB tensors: no padding
    assert info["total_expert_bytes"] == 2 * tf.E * per_expert and info["tensor_format"] == "raw"
    slot = info["slot_bytes"]
    assert info["sizing"]["pins_per_token"] == 2 * tf.TOP_K
    assert info["sizing"]["arena_for_clients"] == {"1": 4 * slot, "4": 8 * slot, "16": 8 * slot}
    assert info["sizing"]["arena_whole_model"] == 8 * slot
    r = _k3d("inspect", path)
    assert r.returncode == 0 and "family    deepseek_v3" in r.stdout and "one client pins 4 slots" in r.stdout


def test_no_match_hint_from_inspect_and_start(tmp_path):
    t = {f"transformer.h.{l}.moe.experts.{e}.w1.weight": np.zeros((4, 4), np.float32)
         for l in range(2) for e in range(2)}
    t["transformer.wte.weight"] = np.zeros((8, 4), np.float32)
    save_file(t, str(tmp_path / "model.safetensors"))
    hint = "try --pattern 'transformer.h.{layer}.moe.experts.{expert}.{name}'"
    r = _k3d("inspect", str(tmp_path))
    assert r.returncode == 1 and hint in r.stderr and "first tensors: transformer.h.0.moe" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = _k3d("start", "--source", str(tmp_path), "--endpoint", f"ipc://{tmp_path}/k.sock")
    assert r.returncode == 1 and hint in r.stderr, r.stderr
    r = _k3d("inspect", str(tmp_path), "--pattern", "transformer.h.{layer}.moe.experts.{expert}.{name}", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["family"] == "pattern"


# -- shipped forms save_pretrained cannot write on a CPU: hand-written with the real names ------------------
def test_gpt_oss_mxfp4_as_shipped(tmp_path):
    """openai/gpt-oss ships MXFP4 experts as stacked ``*_blocks [E, rows, G, 16]`` U8 + ``*_scales [E, rows, G]``
    U8 (+ BF16 biases): served per expert as slices, decoded by k3client.mxfp4 exactly as transformers does."""
    import torch
    from safetensors.torch import save_file as save_torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(3)
    hidden, inter, layers = 64, 32, 2
    t = {}
    for layer in range(layers):
        p = f"model.layers.{layer}.mlp.experts."
        for name, rows, cols in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
            t[p + name + "_blocks"] = torch.randint(0, 256, (tf.E, rows, cols // 32, 16), generator=g,
                                                    dtype=torch.uint8)
            t[p + name + "_scales"] = torch.randint(118, 136, (tf.E, rows, cols // 32), generator=g, dtype=torch.uint8)
            t[p + name + "_bias"] = torch.randn(tf.E, rows, generator=g).to(torch.bfloat16)
        t[f"model.layers.{layer}.mlp.router.weight"] = torch.randn(tf.E, hidden, generator=g).to(torch.bfloat16)
    save_torch(t, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gpt_oss", "num_local_experts": tf.E, "num_experts_per_tok": 2, "experts_per_token": 2,
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "quantization_config": {"quant_method": "mxfp4"}}))
    src = open_source(str(tmp_path), None)
    try:
        assert src.describe()["family"] == "gpt_oss" and src.tensor_format == "gpt-oss:MXFP4"
        assert {s.name for s in src.layout} == {f"{n}_{k}" for n in ("gate_up_proj", "down_proj")
                                                for k in ("blocks", "scales", "bias")}
        slot = bytearray(src.expert_bytes)
        for (layer, e) in sorted(src.keys):
            src.read(src.keys[(layer, e)], memoryview(slot))
            view = {s.name: np.frombuffer(slot, np.uint8, s.nbytes, s.offset) for s in src.layout_of(layer)}
            p = f"model.layers.{layer}.mlp.experts."
            for s in src.layout_of(layer):
                assert view[s.name].tobytes() == t[p + s.name][e].contiguous().view(torch.uint8).numpy().tobytes()
            for name in ("gate_up_proj", "down_proj"):
                spec = {s.name: s for s in src.layout_of(layer)}
                blocks = view[name + "_blocks"].reshape(spec[name + "_blocks"].shape)
                scales = view[name + "_scales"].reshape(spec[name + "_scales"].shape)
                ours = mxfp4.dequantize(blocks, scales, layout="gpt-oss")
                ref = convert_moe_packed_tensors(t[p + name + "_blocks"], t[p + name + "_scales"], dtype=torch.float32)
                assert np.array_equal(ours, ref[e].T.numpy())       # transformers transposes to [H, 2I]
    finally:
        src.close()


def test_deepseek_v3_fp8_as_shipped(tmp_path):
    """deepseek-ai/DeepSeek-V3 ships F8_E4M3 expert weights with F32 ``weight_scale_inv`` per 128x128 block."""
    import torch
    from safetensors.torch import save_file as save_torch

    g = torch.Generator().manual_seed(4)
    hidden, inter = 256, 128
    t = {"model.layers.0.mlp.gate_proj.weight": torch.randn(64, hidden, generator=g).to(torch.float8_e4m3fn)}
    for e in range(tf.E):
        for name, (rows, cols) in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                                   ("down_proj", (hidden, inter))):
            p = f"model.layers.1.mlp.experts.{e}.{name}."
            t[p + "weight"] = torch.randn(rows, cols, generator=g).to(torch.float8_e4m3fn)
            t[p + "weight_scale_inv"] = torch.rand(-(-rows // 128), -(-cols // 128), generator=g)
    t["model.layers.1.mlp.gate.e_score_correction_bias"] = torch.zeros(tf.E)
    t["model.layers.1.mlp.shared_experts.gate_proj.weight"] = torch.zeros(inter, hidden).to(torch.float8_e4m3fn)
    save_torch(t, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "deepseek_v3", "n_routed_experts": tf.E, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}))
    src = open_source(str(tmp_path), None)
    try:
        d = src.describe()
        assert d["family"] == "deepseek_v3" and d["layers"] == [1] and src.tensor_format == "fp8:E4M3"
        spec = {s.name: s for s in src.layout}
        assert spec["gate_proj.weight"].dtype == "F8_E4M3" and spec["gate_proj.weight_scale_inv"].shape == (1, 2)
        slot = bytearray(src.expert_bytes)
        for e in range(tf.E):
            src.read(src.keys[(1, e)], memoryview(slot))
            for s in src.layout:
                ref = t[f"model.layers.1.mlp.experts.{e}.{s.name}"].contiguous().view(torch.uint8).numpy()
                assert bytes(slot[s.offset:s.offset + s.nbytes]) == ref.tobytes()
    finally:
        src.close()


def test_two_families_in_one_checkpoint_refused_at_start(tmp_path):
    save_file({"model.layers.0.mlp.experts.0.gate_proj.weight": np.zeros((4, 4), np.float32),
               "model.layers.0.feed_forward.experts.gate_up_proj": np.zeros((2, 4, 8), np.float32)},
              str(tmp_path / "model.safetensors"))
    r = _k3d("start", "--source", str(tmp_path), "--endpoint", f"ipc://{tmp_path}/k.sock")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert "two families match this checkpoint: experts.mlp" in lines[0] and "stacked.feed_forward" in lines[0]
