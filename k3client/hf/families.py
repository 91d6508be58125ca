"""Which math computes a transformers experts module (``family_for``).

The math itself is the runtime's (``k3client.runtime.families``: ``Standard``, the
gated MLP of Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, GraniteMoE; ``GptOss``,
bf16 and MXFP4 as shipped); this module maps a transformers experts class to it,
bit for bit equal to ``experts_implementation="eager"`` on CPU, and recognises any
other family whose experts module runs Mixtral's eager loop unchanged
(``runs_standard_loop``).  A family not recognised is a one-line ``FamilyError``
naming it and the supported ones.  Pure functions; any thread.
"""

from __future__ import annotations

import functools
import inspect

from ..runtime.families import FUSED_NAMES, SPLIT_NAMES, FamilyError, GptOss, Standard

# experts class -> math; the families the tests compute against eager, bit for bit
FAMILIES = {
    "MixtralExperts": ("Mixtral", Standard),
    "Qwen2MoeExperts": ("Qwen2-MoE", Standard),
    "Qwen3MoeExperts": ("Qwen3-MoE", Standard),
    "DeepseekV3Experts": ("DeepSeek-V3", Standard),
    "GraniteMoeExperts": ("GraniteMoE", Standard),
    "GptOssExperts": ("gpt-oss", GptOss),
}


__all__ = ["FAMILIES", "FUSED_NAMES", "SPLIT_NAMES", "FamilyError", "GptOss", "Standard", "family_for",
           "runs_standard_loop", "supported"]


def supported() -> str:
    return (", ".join(sorted(v[0] for v in FAMILIES.values()))
            + ", and any family whose experts module runs Mixtral's eager loop unchanged")


def _loop_source(cls) -> str | None:
    """The eager forward's code, without comments, blank lines and its ``def`` line."""
    fn = getattr(cls.forward, "__wrapped__", None)
    try:
        src = inspect.getsource(fn) if fn is not None else None
    except (OSError, TypeError):
        return None
    if src is None:
        return None
    lines = [ln.strip() for ln in src.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    body = "\n".join(lines)
    return body[body.index(") -> torch.Tensor:"):] if ") -> torch.Tensor:" in body else None


@functools.cache
def _standard_loop() -> str | None:
    from transformers.models.mixtral.modeling_mixtral import (
        MixtralExperts,  # the reference loop
    )

    return _loop_source(MixtralExperts)


def runs_standard_loop(module) -> bool:
    """True when the module's eager forward is Mixtral's loop, flags included (gated, fused, no bias)."""
    if not (module.has_gate and module.is_concatenated and not module.is_transposed and not module.has_bias
            and not getattr(module, "has_post_expert_norm", False)):
        return False
    ref = _standard_loop()
    return ref is not None and _loop_source(type(module)) == ref


def family_for(experts_module, model_type: str, names: set[str]):
    """The math for ``experts_module`` given the daemon's layout names, or FamilyError."""
    cls = type(experts_module).__name__
    entry = FAMILIES.get(cls)
    if entry is None and runs_standard_loop(experts_module):
        entry = (model_type, Standard)
    if entry is None:
        raise FamilyError(f"k3client.hf cannot compute the experts of model type {model_type!r} ({cls}); "
                          f"supported families: {supported()}")
    try:
        return entry[1](names)
    except FamilyError as e:
        raise FamilyError(f"{entry[0]}: {e}") from None
