"""Shared by tests/integration/test_vllm_*.py: tiny checkpoints, real vLLM CPU engines, references.

Every test module here is marked ``vllm`` and skipped, with one line, where vLLM
is not importable (``pip install -e '.[test,vllm]'``; docs/guides/vllm.md).  Engines
are vLLM's own ``LLM`` in this process (its engine core in a child process, as
``vllm serve`` runs it), float32, eager, greedy, with a small fixed KV cache so
that several fit beside the other tests.  An engine takes ~30 s to start
(~55 s for MLA): modules share engines through module-scoped fixtures.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import os
import re
import shutil
import sys
import tempfile

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (pip install -e '.[test,vllm]')")
torch = pytest.importorskip("torch")

from k3d.demo import hf_models, vllm_models  # noqa: E402  (after the skips above)

# ``LLM.apply_model`` ships a function to the worker by reference (k3client.vllm.stats)
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

# An explicit KV cache: vLLM's CPU worker otherwise sizes it as a share of RAM minus the
# weights, so a model without expert weights would get a larger cache and the PSS
# comparison of test_vllm_shared would measure that; it also skips the warm-up forward.
KV_BYTES = 64 << 20
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 40, 90, 3, 17, 60], [100, 5]]
MAX_TOKENS = 8

_CACHE: dict = {}
_ROOT: list[str] = []          # this module's checkpoint directory, made on first use


SHM = "/dev/shm"
_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


@pytest.fixture(autouse=True, scope="module")
def _vllm_ipc_files():
    """vLLM's engines leave their ipc files (``TMPDIR/<uuid>``, ``TMPDIR/vllm_dist_*``) and
    torch's compile cache (``TMPDIR/torchinductor_<user>``, made by the functions vLLM
    compiles even in eager mode) behind, and a killed vLLM process its shared memory; they are
    vLLM's, not k3d's: removed after each module, with this module's checkpoints, so the
    session's leftover check sees only what k3d's code leaves."""
    tmp = tempfile.gettempdir()
    before, shm_before = set(os.listdir(tmp)), set(os.listdir(SHM))
    yield
    # Python shared-memory segments (``/dev/shm/psm_*``, hundreds of MiB each) of vLLM
    # processes this module killed, and the CPU build's tensor-parallel all-reduce buffers
    # (``/dev/shm/vllm_dist_*-cpushm_*``, 4 MiB per rank, left by every TP engine's shutdown):
    # nobody unlinks them.  Only new ones that no live process maps go (a concurrent run's
    # segments in use are left alone).
    new = {n for n in set(os.listdir(SHM)) - shm_before if n.startswith(("psm_", "vllm_dist_"))}
    for name in _unmapped(new):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(SHM, name))
    for name in set(os.listdir(tmp)) - before:
        if _UUID.match(name) or name.startswith(("vllm_dist_", "torchinductor_")):
            path = os.path.join(tmp, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(path)
    _CACHE.clear()
    while _ROOT:
        shutil.rmtree(_ROOT.pop(), ignore_errors=True)



def _unmapped(names: set[str]) -> set[str]:
    """Those of the /dev/shm ``names`` that no process here has mapped."""
    for maps in glob.glob("/proc/[0-9]*/maps"):
        if not names:
            break
        with contextlib.suppress(OSError):
            with open(maps) as f:
                text = f.read()
            names = {n for n in names if f"{SHM}/{n}" not in text}
    return names

def checkpoint(family: str, split: bool = False, **sizes) -> str:
    """A tiny ``family`` checkpoint vLLM's CPU engine runs; ``split``: experts in their own shard."""
    key = (family, split, tuple(sorted(sizes.items())))
    if key not in _CACHE:
        if not _ROOT:                              # removed after each module (_vllm_ipc_files)
            _ROOT.append(tempfile.mkdtemp(prefix="k3d-vllm-tests-"))
        out = tempfile.mkdtemp(prefix=f"{family}-", dir=_ROOT[0])
        if split:
            hf_models.split_experts(checkpoint(family, **sizes), out)
        else:
            vllm_models.write(family, out, **sizes)
        _CACHE[key] = out
    return _CACHE[key]


# What plain vLLM's engine prints when it cannot run a configuration on this CPU: (its error, the vLLM
# source file the error comes from, why in words).  vLLM 0.32 picks AMX_MLA for an MLA model wherever
# torch reports AMX tiles (platforms/cpu.py), and its process_weights_after_loading packs kv_b_proj
# with convert_weight_packed, which takes no float32.
PLAIN_LIMITS = (
    ("expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8", "amx_mla.py",
     "its AMX_MLA attention backend needs bf16/fp16/int8 weights"),
)


def plain_limit(stderr: str) -> str | None:
    """Why plain vLLM failed, in words, where its stderr shows a known limit of one of its backends."""
    for error, source, why in PLAIN_LIMITS:
        if error in stderr and source in stderr:
            return why
    return None


def skip_where_plain_vllm_cannot(path: str, dtype: str) -> None:
    """After plain vLLM failed to build an engine on ``path``: rebuild it in a fresh process (its engine
    core's traceback goes to that child's stderr, which the engine's own error only points to) and skip
    in one line where the cause is a known limit of vLLM on this CPU; else return (the caller raises)."""
    import json

    import vllm

    _, _, err = run_engine_script(path, None, dtype=dtype)
    why = plain_limit(err)
    if why is not None:
        with open(os.path.join(path, "config.json")) as f:
            model_type = json.load(f).get("model_type", "?")
        version = ".".join(vllm.__version__.split(".")[:2])
        pytest.skip(f"plain vLLM {version} cannot run {dtype} {model_type} on this CPU ({why})")


@contextlib.contextmanager
def plain_engine(path: str, max_num_seqs: int = 4, dtype: str = "float32", **kwargs):
    """``engine(path)`` without k3d, the reference of a comparison: where plain vLLM itself cannot run the
    configuration on this CPU the test skips in one line naming vLLM and the backend (the cause is
    read from a one-rank rebuild: an attention backend's limit does not depend on ``kwargs`` such as
    ``tensor_parallel_size``)."""
    with contextlib.ExitStack() as stack:
        try:
            llm = stack.enter_context(engine(path, max_num_seqs=max_num_seqs, dtype=dtype, **kwargs))
        except Exception:
            skip_where_plain_vllm_cannot(path, dtype)
            raise
        yield llm


@contextlib.contextmanager
def engine(path: str, k3d: dict | None = None, max_num_seqs: int = 4, dtype: str = "float32", **kwargs):
    """vLLM's ``LLM`` on ``path`` (with ``additional_config={"k3d": k3d}`` when given), shut down after;
    ``kwargs`` go to ``LLM`` as they are (``tensor_parallel_size``, ...)."""
    from vllm import LLM

    extra = {"additional_config": {"k3d": k3d}} if k3d is not None else {}
    extra.update(kwargs)
    llm = LLM(model=path, enforce_eager=True, kv_cache_memory_bytes=KV_BYTES, skip_tokenizer_init=True,
              dtype=dtype, max_model_len=128, max_num_seqs=max_num_seqs, seed=0, **extra)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def generate(llm, prompts=PROMPTS, one_by_one: bool = False, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """Greedy tokens per prompt: all prompts in one call (batched steps), or one call per prompt (B = 1)."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    if one_by_one:
        return [generate(llm, [p], max_tokens=max_tokens)[0] for p in prompts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def stats(llm) -> dict:
    from k3client.vllm import stats as model_stats

    (s,) = llm.apply_model(model_stats)
    return s


def expert_params(model) -> list[str]:
    """Names of the routed-expert parameters (weights, gpt-oss's biases) in a vLLM model (run in the
    worker by ``apply_model``)."""
    return [n for n, _ in model.named_parameters() if n.endswith(("w13_weight", "w2_weight", "w13_bias", "w2_bias"))]


def run_engine_script(path: str, k3d: dict | None, timeout: float = 300, dtype: str = "float32",
                      prelude: str = "", env: dict | None = None, **engine_args):
    """A fresh Python that builds an in-process engine (no engine-core child) and exits: its stderr's last line.
    ``k3d`` None: plain vLLM (no additional_config); ``prelude``: code run before the engine is built;
    ``env``: extra environment; ``engine_args``: ``LLM`` arguments over the defaults (e.g. ``enforce_eager=False``)."""
    import subprocess

    extra = f", additional_config={{'k3d': {k3d!r}}}" if k3d is not None else ""
    args = {"enforce_eager": True, **engine_args}
    extra += "".join(f", {k}={v!r}" for k, v in args.items())
    code = (f"{prelude}\nfrom vllm import LLM\n"
            f"LLM(model={path!r}, kv_cache_memory_bytes={KV_BYTES}, skip_tokenizer_init=True,"
            f" dtype={dtype!r}, max_model_len=128, max_num_seqs=1{extra})\n")
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", **(env or {}))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout,
                       check=False)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    return r.returncode, (lines[-1] if lines else ""), r.stderr


def first_logprobs(llm, prompts=PROMPTS, k: int = 5) -> list[dict[int, float]]:
    """Per prompt, the top-``k`` log-probabilities of the first generated token (one step, no divergence)."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=k)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs]
