"""What a vLLM engine with the ``k3d`` key must not run: each refused in one line, before any weight is read.

The runtime's work per MoE layer is Python and IPC (a fetch over ZeroMQ, views of the
arena, copies), and its epochs follow the loader's forward pre-hook: one model forward
is one vLLM step is one epoch, on the thread that loaded the model.  So, with
``additional_config['k3d']``, ``K3dLoader`` refuses (``ValueError``, one line):

- ``config_refusal`` (before it connects to the daemon), on any device:

  - compilation on (``compilation_config.mode`` other than ``NONE``): Dynamo would trace
    into the client.  vLLM's CPU build turns its default ``VLLM_COMPILE`` into
    ``DYNAMO_TRACE_ONCE`` (``CpuPlatform.check_and_update_config``), so a CPU engine
    without ``enforce_eager`` compiles too; ``enforce_eager`` sets both modes to ``NONE``;
  - CUDA graphs on (``compilation_config.cudagraph_mode`` other than ``NONE``): a graph
    replays a step's kernels without the fetches (stale experts);
  - speculative decoding (``speculative_config``): its drafter runs a second model, or
    this one again, inside a step, and a drafter built with the key would be a second k3d
    model in the process;
  - dual-batch overlap / micro-batching (``parallel_config.enable_dbo``, ``ubatch_size`` > 1):
    a step runs as micro-batches on two threads, each crossing the MoE layers;
  - pipeline parallelism (``pipeline_parallel_size`` > 1): a rank holds some of the MoE
    layers, and a step's forward there is not the step's last MoE layer;
  - the pooling runner (``model_config.runner_type`` ``pooling``): untested, its forwards
    are not generation steps;

  - data parallelism (``data_parallel_size`` > 1) on a CPU: vLLM's CPU build cannot run
    it for a MoE model (``CpuCommunicator`` has no ``all_gatherv``, which the MoE layers'
    naive DP dispatch calls; plain vLLM 0.32 dies at its first step), so the line names
    vLLM; one engine per rank, each a client of the same daemon, serves the same load;

  async scheduling is not refused: the forward still runs once per step on the worker's
  thread (only the output copy moves to another thread; vLLM's CPU build turns it off);

- ``experts_refusal`` (after vLLM builds the model, before it loads a weight): the
  model's MoE layers are not the plugin's classes with its method.  vLLM builds a layer
  through ``PluggableLayer``'s out-of-tree registry, and a vLLM whose model code reads
  another registry (vllm#53153: the hardware-agnostic layers under
  ``VLLM_USE_HW_AGNOSTIC=1`` keep their own) silently builds its own layer: that engine
  would then load and compute the experts itself, each rank reading the whole checkpoint.

Pure functions of the config and the model; any thread.
"""

from __future__ import annotations

import os

EAGER_HINT = "pass enforce_eager=True (--enforce-eager)"
# environment variables under which a vLLM release is known to bypass the out-of-tree layer registry
BYPASS_ENV = ("VLLM_USE_HW_AGNOSTIC",)


def compile_refusal(cudagraph_mode, compile_mode) -> str | None:
    """Why an engine with these modes cannot serve k3d experts, or None (both ``NONE`` or unresolved).

    ``cudagraph_mode``/``compile_mode``: vLLM's ``CUDAGraphMode``/``CompilationMode`` (or their
    names); only the names are read."""
    on = []
    if cudagraph_mode is not None and _name(cudagraph_mode) != "NONE":
        on.append(f"CUDA graphs ({_name(cudagraph_mode)})")
    if compile_mode is not None and _name(compile_mode) != "NONE":
        on.append(f"torch.compile ({_name(compile_mode)})")
    if not on:
        return None
    return (f"k3client.vllm: this engine runs {' and '.join(on)}, which would replay or trace a step "
            f"without the k3d runtime's fetches; {EAGER_HINT}")


def runner_refusal(vllm_config) -> str | None:
    """Why this engine's model runner would run the model other than once per step on one thread, or None."""
    pc = getattr(vllm_config, "parallel_config", None)
    mc = getattr(vllm_config, "model_config", None)
    why = None
    if getattr(vllm_config, "speculative_config", None) is not None:
        why = "speculative decoding (speculative_config), whose drafter runs inside a step"
    elif getattr(pc, "enable_dbo", False) or (getattr(pc, "ubatch_size", 0) or 0) > 1:
        why = "dual-batch overlap / micro-batching (enable_dbo, ubatch_size), which runs a step on two threads"
    elif (getattr(pc, "pipeline_parallel_size", 1) or 1) > 1:
        why = "pipeline parallelism (pipeline_parallel_size > 1), where a rank runs part of a step's layers"
    elif getattr(mc, "runner_type", "generate") == "pooling":
        why = "the pooling runner (runner='pooling')"
    if why is None:
        return None
    return (f"k3client.vllm: this engine runs {why}; the k3d runtime counts one model forward as one step "
            "(remove the option, or serve this model without the k3d additional_config)")


def parallel_refusal(vllm_config) -> str | None:
    """Why vLLM itself cannot run this engine's parallelism on its device, or None."""
    pc = getattr(vllm_config, "parallel_config", None)
    dp = getattr(pc, "data_parallel_size", 1) or 1
    device = str(getattr(getattr(vllm_config, "device_config", None), "device_type", None) or "cpu")
    if dp > 1 and device == "cpu":
        return (f"vLLM's CPU build cannot run a MoE model with data_parallel_size={dp}: its CPU communicator has "
                "no all_gatherv for the MoE layers' data-parallel dispatch (plain vLLM stops with "
                "NotImplementedError at its first step); run one engine per rank instead, each a client of "
                "the same k3d")
    return None


def config_refusal(vllm_config) -> str | None:
    """The first of ``compile_refusal``, ``runner_refusal`` and ``parallel_refusal`` of a ``VllmConfig``."""
    cc = getattr(vllm_config, "compilation_config", None)
    return (compile_refusal(getattr(cc, "cudagraph_mode", None), getattr(cc, "mode", None))
            or runner_refusal(vllm_config) or parallel_refusal(vllm_config))


def experts_refusal(built: list[tuple[str, str, bool]], replaced: tuple[str, ...]) -> str | None:
    """Why the built model's experts are not the plugin's though it replaced their class, or None.

    ``built``: ``(module name, class name, is the plugin's layer with its method)`` of every
    routed-experts module vLLM built; ``replaced``: the class names the plugin registered out
    of tree.  A module of another class (a ``RoutedExperts`` subclass the plugin does not
    replace) is not this guard's: the loader refuses its family."""
    bypassed = [(name, cls) for name, cls, mine in built if not mine and cls in replaced]
    if not bypassed:
        return None
    name, cls = bypassed[0]
    env = [f"{v}={os.environ[v]}" for v in BYPASS_ENV if os.environ.get(v, "").lower() in ("1", "true")]
    cause = (f"this vLLM bypasses its out-of-tree layer registry under {', '.join(env)} (vllm#53153); unset it"
             if env else "this vLLM did not use the plugin's out-of-tree registration (PluggableLayer.register_oot)"
             "; serve with a covered vLLM release")
    return (f"k3client.vllm: vLLM built its own {cls} for {len(bypassed)} MoE layer(s) ({name}, ...), which "
            f"would read and compute the experts itself: {cause}")


def _name(mode) -> str:
    return str(getattr(mode, "name", mode)).upper()
