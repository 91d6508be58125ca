"""What the integrations refuse or switch off where CUDA graphs or compile would capture them.

The runtime's work per MoE layer is Python and IPC (a fetch over ZeroMQ, views of the
arena, copies): a CUDA graph replays a step's kernels without any of it (stale
experts), and Dynamo would trace into the client.

- transformers: the ``"k3d"`` experts forward is ``torch.compiler.disable``d (a graph
  break: a compiled model runs it eagerly), and ``load_model`` sets the model's
  ``generation_config.disable_compile``, so a static-cache ``generate`` (which
  transformers 5 would otherwise compile on CUDA, with CUDA graphs) runs eagerly;
- vLLM: ``vllm_refusal`` names, in one line, an engine on CUDA with CUDA graphs or
  compilation on, unless ``enforce_eager``; the loader raises it before connecting.

Pure functions; any thread.
"""

from __future__ import annotations

EAGER_HINT = "pass enforce_eager=True (--enforce-eager)"


def vllm_refusal(device_type: str, enforce_eager: bool, cudagraph_mode, compile_mode) -> str | None:
    """Why an engine with these settings cannot serve k3d experts, or None when it can.

    ``cudagraph_mode``/``compile_mode``: vLLM's ``CUDAGraphMode``/``CompilationMode`` (or
    None, unresolved); only their names are read."""
    if device_type != "cuda" or enforce_eager:
        return None
    on = []
    if cudagraph_mode is not None and _name(cudagraph_mode) != "NONE":
        on.append(f"CUDA graphs ({_name(cudagraph_mode)})")
    if compile_mode is not None and _name(compile_mode) != "NONE":
        on.append(f"compilation ({_name(compile_mode)})")
    if not on:
        return None
    return (f"k3client.vllm: this engine runs {' and '.join(on)}, which would replay or trace a step "
            f"without the k3d runtime's fetches; {EAGER_HINT}")


def vllm_config_refusal(vllm_config) -> str | None:
    """``vllm_refusal`` of a ``VllmConfig``."""
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", None) or "cpu"
    mc = getattr(vllm_config, "model_config", None)
    cc = getattr(vllm_config, "compilation_config", None)
    return vllm_refusal(str(device), bool(getattr(mc, "enforce_eager", False)),
                        getattr(cc, "cudagraph_mode", None), getattr(cc, "mode", None))


def _name(mode) -> str:
    return str(getattr(mode, "name", mode)).upper()
