"""load_model: routed experts never read nor held; one-line refusals for bad input."""

import ctypes
import mmap
import os
import subprocess
import sys

import numpy as np
import pytest
from hf_common import checkpoint, daemon_args, hf_models, torch

import k3client
from helpers import served_digest

PAGE = os.sysconf("SC_PAGE_SIZE")




def _resident_pages(path: str, start: int) -> tuple[int, int]:
    """(resident, total) page-cache pages of ``path`` from ``start`` on, by mincore(2)."""
    size = os.path.getsize(path)
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
        try:
            addr = np.frombuffer(mm, dtype=np.uint8, count=1).ctypes.data
            pages = (size + PAGE - 1) // PAGE
            vec = (ctypes.c_ubyte * pages)()
            assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0
            first = start // PAGE
            return sum(v & 1 for v in vec[first:]), pages - first
        finally:
            mm.close()


def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_expert_bytes_never_read_nor_allocated(start_daemon, tmp_path):
    """No page of the experts shard enters the page cache during load_model; meta, no storage."""
    from k3client.hf import load_model

    path = hf_models.split_experts(checkpoint("qwen3_moe", hidden=128, inter=256), str(tmp_path / "split"))
    shard = os.path.join(path, "experts.safetensors")
    d = start_daemon(path, *daemon_args("qwen3_moe", arena="16MiB"))
    with k3client.connect(d.endpoint, name="digest") as c:
        served_digest(c)     # the daemon's digest after ready samples this shard: done before the drop
    head = 1 << 20       # the safetensors header (and its readahead) is read: skip the first MiB
    assert os.path.getsize(shard) > 4 * head
    _drop_cache(shard)
    _drop_cache(os.path.join(path, "rest.safetensors"))
    before, total = _resident_pages(shard, head)
    assert before == 0, f"could not drop the page cache ({before}/{total} pages resident)"
    model = load_model(path, endpoint=d.endpoint, dtype=torch.bfloat16)
    try:
        after, _ = _resident_pages(shard, head)
        assert after == 0, f"load_model read {after} of {total} pages of the experts shard"
        rest, _ = _resident_pages(os.path.join(path, "rest.safetensors"), 0)
        assert rest > 0, "the method sees reads: the non-expert shard was read"
        for ml in model.k3d.layers.values():
            t = ml.module.gate_up_proj
            assert t.device.type == "meta" and not isinstance(t, torch.nn.Parameter)
        # a forward fetches them from the daemon, which reads the shard (not this process)
        with torch.no_grad():
            model(torch.zeros(1, 3, dtype=torch.long))
        assert model.k3d.stats.experts_fetched > 0
    finally:
        model.k3d.client.close()


def test_daemon_down_is_one_line_naming_the_endpoint(tmp_path):
    from k3client.hf import load_model

    ep = f"ipc://{tmp_path}/none.sock"
    with pytest.raises(k3client.DaemonNotRunning) as e:
        load_model(checkpoint("qwen3_moe"), endpoint=ep)
    assert ep in str(e.value) and "\n" not in str(e.value)


def test_other_checkpoint_refused_in_one_line(start_daemon):
    from k3client.hf import Mismatch, load_model

    served = checkpoint("qwen3_moe")
    other = checkpoint("qwen3_moe", hidden=96)          # same family, other shapes
    d = start_daemon(served, *daemon_args("qwen3_moe"))
    with pytest.raises(Mismatch) as e:
        load_model(other, endpoint=d.endpoint)
    msg = str(e.value)
    assert "\n" not in msg and served in msg and other in msg and "k3d start --source" in msg
    with pytest.raises(Mismatch, match="w1.weight"):     # another family: other layout names
        load_model(checkpoint("mixtral"), endpoint=d.endpoint)
    with pytest.raises(Mismatch, match="4 per layer"):   # other expert count
        load_model(checkpoint("qwen3_moe", experts=4), endpoint=d.endpoint)


def test_family_without_implementation_named(start_daemon, tmp_path):
    """A family whose experts do not dispatch through ExpertsInterface (Llama 4) is named, with the supported."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    from k3client.hf import FamilyError, load_model

    cfg = Llama4TextConfig(vocab_size=64, hidden_size=32, intermediate_size=32, intermediate_size_mlp=64,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                           num_local_experts=4, num_experts_per_tok=1)
    path = str(tmp_path / "llama4")
    Llama4ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    d = start_daemon(path, *daemon_args("llama4"))        # the daemon serves it: verify passes, then this
    with pytest.raises(FamilyError) as e:
        load_model(path, endpoint=d.endpoint, model_class=Llama4ForCausalLM)
    msg = str(e.value)
    assert "llama4" in msg and "Mixtral" in msg and "DeepSeek-V3" in msg and "\n" not in msg


def test_transformers_older_than_5_is_one_line(tmp_path):
    """Import-time check, against a transformers 4.x package on the path."""
    fake = tmp_path / "site" / "transformers"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('__version__ = "4.57.1"\n')
    env = dict(os.environ, PYTHONPATH=f"{tmp_path / 'site'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    r = subprocess.run([sys.executable, "-c", "import k3client.hf"], env=env, capture_output=True, text=True,
                       check=False)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert "ImportError: k3client.hf needs transformers >= 5 (found 4.57.1" in last


def test_k3client_imports_without_torch_or_transformers():
    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
            "import k3client; print(k3client.connect.__name__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert r.returncode == 0 and r.stdout.strip() == "connect", r.stderr


def test_expert_bytes_helper_counts_only_routed_experts():
    from safetensors import safe_open

    path = checkpoint("qwen2_moe")
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        want = sum(f.get_tensor(k).nbytes for k in f.keys() if ".experts." in k)  # noqa: SIM118
    assert hf_models.expert_bytes(path) == want > 0
