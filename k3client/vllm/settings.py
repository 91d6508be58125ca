"""The ``k3d`` entry of vLLM's ``additional_config``: whether a model is served through k3d, and how.

``{"k3d": {"endpoint": str | None, "name": str | None, "predict": bool, "native": bool}}``;
every key is optional (``{"k3d": {}}`` uses the default endpoint, a name from the pid,
gate-ahead predictions, and the native expert kernel where the CPU has AVX-512:
``k3client.vllm.native``; ``"native": false`` computes every expert with torch).
An unknown key or a wrong type is a one-line ``ValueError`` naming it, raised where
the model is built, before any weight is read.  Pure functions of the config; any thread.
"""

from __future__ import annotations

from dataclasses import dataclass

KEY = "k3d"


@dataclass(frozen=True)
class Settings:
    endpoint: str | None = None
    name: str | None = None
    predict: bool = True
    native: bool = True


_TYPES = {"endpoint": (str, type(None)), "name": (str, type(None)), "predict": (bool,), "native": (bool,)}


def from_config(vllm_config) -> Settings | None:
    """The model's k3d settings, or None when its engine was not asked to use k3d."""
    extra = getattr(vllm_config, "additional_config", None)
    if not isinstance(extra, dict) or KEY not in extra:
        return None
    raw = extra[KEY]
    if raw is None or raw is True:
        raw = {}
    if not isinstance(raw, dict):
        raise ValueError(f"additional_config['k3d'] must be an object with keys {sorted(_TYPES)}, not {raw!r}")
    unknown = sorted(set(raw) - set(_TYPES))
    if unknown:
        raise ValueError(f"additional_config['k3d'] has unknown keys {unknown}; known: {sorted(_TYPES)}")
    for k, v in raw.items():
        if not isinstance(v, _TYPES[k]):
            raise ValueError(f"additional_config['k3d'][{k!r}] = {v!r}: expected "
                             f"{' or '.join(t.__name__ for t in _TYPES[k])}")
    return Settings(**raw)


def current() -> Settings | None:
    """``from_config`` of the vLLM config being built or run in this process (vLLM's context)."""
    from vllm.config import get_current_vllm_config

    return from_config(get_current_vllm_config())
