"""k3client.vllm: vLLM serves a MoE model whose routed experts come from the k3d daemon.

Installed with ``pip install 'k3d-expert-cache[vllm]'``, this package is a vLLM general plugin
(entry point ``vllm.general_plugins`` -> ``k3d = k3client.vllm:register``), so every
vLLM process loads it: the front end, the engine core, the workers.  Loading it
changes nothing by itself; a model is served through k3d only when its engine
gets ``additional_config={"k3d": {...}}`` (``--additional-config`` on ``vllm
serve``)::

    LLM(model="/models/Qwen3-30B-A3B", enforce_eager=True,
        additional_config={"k3d": {"endpoint": "ipc:///run/k3d/k3d.sock", "predict": True}})

What ``register`` installs, through vLLM's own extension points:

- ``RoutedExperts`` (a ``PluggableLayer``) is replaced out of tree by
  ``experts.K3dRoutedExperts``, and gpt-oss's subclass ``GptOssRoutedExperts`` by
  ``experts.K3dGptOssRoutedExperts``: with the ``k3d`` key their quant method
  allocates no expert parameter and computes the experts from arena views; without
  it, the classes are vLLM's own, unchanged;
- the ``auto``/``safetensors`` load formats get ``loader.K3dLoader``, vLLM's
  ``DefaultModelLoader`` that, with the ``k3d`` key, connects to the daemon first,
  checks it serves this checkpoint and never reads the routed-expert tensors.

Computed, and tested against plain vLLM: Qwen3-MoE, Mixtral, DeepSeek-V3, gpt-oss in
bf16 (vLLM's own router picks the experts).  The same math serves any family whose
experts vLLM builds with plain ``RoutedExperts`` as gated SiLU/GELU experts without
bias (Qwen2-MoE, DeepSeek-V2, ...: untested).  Anything else (quantized experts, gpt-oss's
MXFP4 as shipped among them, which vLLM's CPU build itself runs only on AMX CPUs;
other ``RoutedExperts`` subclasses) is refused at load in one line naming the model type.

Tensor parallelism (``tensor_parallel_size=N``): every rank is a daemon client of its
own (``vllm-<pid>-tp<rank>``) and computes its shard of each expert from the shared
whole-expert views (``ranks``); vLLM all-reduces the ranks' outputs.  Expert
parallelism computes each rank's own experts (vLLM's expert map), but vLLM 0.32's CPU
build cannot run it, so a CPU engine with it is refused in one line naming vLLM.

Covered vLLM versions: ``SUPPORTED_VLLM``.  The plugin reaches into internals
that change between releases (``RoutedExperts``' quant-method hook,
``DefaultModelLoader``'s weight iterator), so on another release it logs one
warning and installs nothing: that vLLM runs plain, the ``k3d`` key unused.

Caller's obligations: a ``k3d start`` serving the same checkpoint; eager mode
(``enforce_eager=True`` / ``--enforce-eager``), on any device: a CUDA graph would replay
a step without its Python fetches and ``torch.compile`` (which vLLM's CPU build turns on
by default) would trace into the client; an engine that runs the model once per step on
one thread (no speculative decoding, dual-batch overlap, pipeline parallelism or pooling
runner); on a CPU engine, no expert or data parallelism (vLLM's CPU build cannot run
them: the line names vLLM; ``ranks``, ``guards``).  Each of these is refused in one
line before any weight is read, and so is an engine whose vLLM did not build the
plugin's experts layers (``guards``).
"""

from __future__ import annotations

SUPPORTED_VLLM = ("0.32",)      # the releases the tests ran against (major.minor)
_registered = False


def _check_version() -> None:
    import vllm

    mm = ".".join(vllm.__version__.split(".")[:2])
    if mm not in SUPPORTED_VLLM:
        raise ImportError(f"k3client.vllm supports vLLM {', '.join(SUPPORTED_VLLM)} (found {vllm.__version__}); "
                          "pin vllm to a covered release or remove the k3d additional_config")


def register() -> None:
    """The ``vllm.general_plugins`` hook: called in every vLLM process, before any model is built.

    Idempotent.  A vLLM outside ``SUPPORTED_VLLM`` gets one warning and nothing is
    installed: raising here would break every vLLM process on the host, k3d or not."""
    global _registered
    if _registered:
        return
    try:
        _check_version()
    except ImportError as e:
        import logging

        logging.getLogger("k3client.vllm").warning("%s; the k3d plugin is not installed in this process", e)
        return
    from . import experts, loader

    experts.install()
    loader.install()
    _registered = True


def stats(model) -> dict:
    """The k3d counters of a model served through k3d (``LLM.apply_model(k3client.vllm.stats)``)."""
    rt = getattr(model, "k3d", None)
    if rt is None:
        return {}
    return {**rt.stats.as_dict(), "daemon_restarts": rt.client.restarts}
