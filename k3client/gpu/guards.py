"""What the integrations refuse or switch off where CUDA graphs or compile would capture them.

The runtime's work per MoE layer is Python and IPC (a fetch over ZeroMQ, views of the
arena, copies): a CUDA graph replays a step's kernels without any of it (stale
experts), and Dynamo would trace into the client.

- transformers: the ``"k3d"`` experts forward is ``torch.compiler.disable``d (a graph
  break: a compiled model runs it eagerly), and ``load_model`` sets the model's
  ``generation_config.disable_compile``, so a static-cache ``generate`` (which
  transformers 5 would otherwise compile on CUDA, with CUDA graphs) runs eagerly;
- vLLM: ``k3client.vllm.guards`` refuses, in one line and on any device, an engine with
  CUDA graphs or compilation on (no ``enforce_eager``), among the other engine
  configurations the plugin cannot serve; the loader raises it before connecting.

Documentation only: the code lives where each integration applies it.
"""
