"""CUDA vLLM only (skipped elsewhere): the plugin on a GPU engine, and its refusal of CUDA graphs.

Run beside tests/integration/test_hf_gpu.py on a lent GPU machine.  Needs a CUDA build
of vLLM (this repository's CPU hosts have the CPU build: skipped there).
"""

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA (none on this host)", allow_module_level=True)
vllm_common = pytest.importorskip("vllm_common")
from vllm.platforms import current_platform  # noqa: E402

if not current_platform.is_cuda():
    pytest.skip("needs a CUDA build of vLLM", allow_module_level=True)

from vllm_common import KV_BYTES, _vllm_ipc_files, checkpoint, engine, generate, stats  # noqa: E402, F401 -- the autouse fixture

pytestmark = pytest.mark.vllm


def test_tokens_equal_plain_vllm_on_cuda(start_daemon):
    path = checkpoint("qwen3_moe")
    d = start_daemon(path, "--arena", "64MiB")
    with engine(path) as llm:
        want = generate(llm)
    with engine(path, k3d={"endpoint": d.endpoint}) as llm:
        assert generate(llm) == want
        s = stats(llm)
    assert s["forwards"] > 0 and not s["native_kernel"]
    assert d.stop() == 0


def test_cuda_graphs_are_refused_in_one_line(start_daemon):
    path = checkpoint("qwen3_moe")
    d = start_daemon(path, "--arena", "64MiB")
    code = ("from vllm import LLM\n"
            f"LLM(model={path!r}, kv_cache_memory_bytes={KV_BYTES}, skip_tokenizer_init=True, dtype='float32', "
            f"max_model_len=128, max_num_seqs=1, additional_config={{'k3d': {{'endpoint': {d.endpoint!r}}}}})\n")
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                       check=False)
    assert r.returncode != 0
    assert "k3client.vllm: this engine runs CUDA graphs" in r.stderr and "enforce_eager=True" in r.stderr
    assert d.stop() == 0
