"""Shared by the tests/integration/test_hf_*.py files: tiny checkpoints, daemons, references.

Checkpoints are written once per test session by transformers' own
``save_pretrained`` (``k3d.demo.hf_models``) under one directory that the session
removes when it ends (``leftovers.session_dir``).
"""

from __future__ import annotations

import os

import pytest

from leftovers import session_dir

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5")

from k3d.demo import hf_models  # noqa: E402  (after the transformers skip above)

_ROOT = session_dir("hf-")
_CACHE: dict = {}


def checkpoint(family: str, **sizes) -> str:
    """A tiny ``family`` checkpoint (``gpt_oss_mxfp4``: gpt-oss as shipped); written once."""
    key = (family, tuple(sorted(sizes.items())))
    if key not in _CACHE:
        out = os.path.join(_ROOT, f"{family}-{len(_CACHE)}")
        if family == "gpt_oss_mxfp4":
            hf_models.write_gpt_oss_mxfp4(out, **sizes)
        else:
            hf_models.write(family, out, **sizes)
        _CACHE[key] = out
    return _CACHE[key]


def daemon_args(family: str, arena="8MiB") -> list[str]:
    """``k3d start`` arguments: the daemon recognises every family from config.json (no --pattern)."""
    return ["--arena", str(arena)]


def eager(path: str):
    """transformers' own model with in-process experts (MXFP4 dequantized by transformers)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    kw = {}
    if "mxfp4" in path:
        kw["quantization_config"] = Mxfp4Config(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager", dtype=torch.bfloat16, **kw)


def prompt(batch=2, length=7, seed=1):
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))
