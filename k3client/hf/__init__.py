"""k3client.hf: transformers models whose routed experts come from the k3d daemon.

Needs transformers >= 5 and torch (``pip install 'k3d-expert-cache[hf]'``); ``k3client`` itself
never imports this package, so it stays importable without them.  Importing it
registers the experts implementation ``"k3d"`` with transformers'
``ExpertsInterface``; ``load_model`` returns a model that uses it::

    from k3client.hf import load_model
    model = load_model("/models/Qwen3-30B-A3B", endpoint="ipc:///run/k3d/k3d.sock")
    out = model.generate(ids, max_new_tokens=32)
    model.k3d.stats.as_dict()      # fetches, epochs, predictions used, fetch time per layer

Families computed, bit for bit equal to ``experts_implementation="eager"`` on CPU:
Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, gpt-oss (bf16 and MXFP4 as shipped),
GraniteMoE (``families.FAMILIES``).
"""

from __future__ import annotations

MIN_TRANSFORMERS = 5


def _require_transformers() -> None:
    try:
        import transformers  # optional extra: imported only by this subpackage
    except ImportError:
        raise ImportError("k3client.hf needs transformers >= 5 and torch: pip install 'k3d-expert-cache[hf]'") from None
    major = transformers.__version__.split(".")[0]
    if not major.isdigit() or int(major) < MIN_TRANSFORMERS:
        raise ImportError(f"k3client.hf needs transformers >= {MIN_TRANSFORMERS} (found {transformers.__version__}, "
                          "without ExpertsInterface): pip install -U 'transformers>=5'")


_require_transformers()

# Imported after the version check on purpose: an old transformers gets the one-line
# ImportError above, not a traceback from deep inside these imports.
from transformers.integrations.moe import ExpertsInterface  # noqa: E402

from .families import FAMILIES, FamilyError, supported  # noqa: E402
from .fingerprint import Mismatch  # noqa: E402
from .loader import IMPLEMENTATION, k3d_experts_forward, load_model  # noqa: E402

ExpertsInterface.register(IMPLEMENTATION, k3d_experts_forward)

__all__ = ["FAMILIES", "IMPLEMENTATION", "FamilyError", "Mismatch", "load_model", "supported"]
