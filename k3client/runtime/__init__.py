"""k3client.runtime: the engine-neutral runtime both integrations use.

``k3client.hf`` (transformers) and ``k3client.vllm`` are thin adapters: each builds
``Layer``s from its engine's modules and one ``Runtime``, and hands every MoE layer
call to ``Runtime.run_layer``.  Modules, each one concern:

- ``core``: ``Runtime`` (the layer call, ``_layer_done``);
- ``epochs``: the pin rule, grouped fetches, ``Stats``/``StepStats``;
- ``gate_ahead``: next-layer predictions from its router, and their score;
- ``views``: the one rule for an expert's views;
- ``compute``: the loops matching each engine's numerics, and the experts' math;
- ``dispatch``: which kernel computes a run of rows under vLLM's numerics, per CPU
  (``k3client.cpu``), dtype and layer;
- ``gpt_oss_mxfp4``: gpt-oss's MXFP4 experts as vLLM's CPU kernel computes them;
- ``families``: layout names -> roles, the gated-MLP and gpt-oss math, ``FamilyError``;
- ``layer``: ``Layer`` (what the engine gives), ``Activation``;
- ``gpu``: ``GpuSide`` (CUDA registration, copies, syncs).

Needs torch; imports neither transformers nor vLLM.
"""

from __future__ import annotations

from .core import Runtime
from .epochs import Stats, StepStats
from .families import FamilyError, GptOss, Standard, on
from .layer import ACTIVATIONS, Activation, Layer

__all__ = ["ACTIVATIONS", "Activation", "FamilyError", "GptOss", "Layer", "Runtime", "Standard", "Stats",
           "StepStats", "on"]
