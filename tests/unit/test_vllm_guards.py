"""k3client.vllm.guards: the engine configurations the plugin refuses, each in one line.

Pure functions of the config; the real engines (a CPU engine without ``enforce_eager``, a
bypassed layer registration, data parallelism, the Ray executor) are
tests/integration/test_vllm_ranks.py and test_vllm_load.py.
"""

from types import SimpleNamespace as NS

import pytest

from k3client.vllm import guards


def _config(device="cpu", mode="NONE", graphs="NONE", spec=None, dbo=False, ubatch=0, pp=1, dp=1,
            runner="generate"):
    return NS(device_config=NS(device_type=device), compilation_config=NS(mode=mode, cudagraph_mode=graphs),
              speculative_config=spec, model_config=NS(runner_type=runner),
              parallel_config=NS(enable_dbo=dbo, ubatch_size=ubatch, pipeline_parallel_size=pp,
                                 data_parallel_size=dp))


@pytest.mark.parametrize("graphs,compiled,named", [
    ("FULL_AND_PIECEWISE", "VLLM_COMPILE", "CUDA graphs (FULL_AND_PIECEWISE) and torch.compile (VLLM_COMPILE)"),
    ("NONE", "DYNAMO_TRACE_ONCE", "torch.compile (DYNAMO_TRACE_ONCE)"),      # vLLM's CPU default
    ("PIECEWISE", "NONE", "CUDA graphs (PIECEWISE)"),
])
def test_graphs_or_compile_on_any_device_is_one_line(graphs, compiled, named):
    for device in ("cpu", "cuda"):
        why = guards.config_refusal(_config(device, compiled, graphs))
        assert named in why and "enforce_eager=True" in why and "\n" not in why


def test_eager_engine_passes():
    assert guards.config_refusal(_config()) is None
    assert guards.compile_refusal(None, None) is None          # unresolved modes: nothing to name


def test_real_vllm_modes_are_read_by_name():
    pytest.importorskip("vllm")
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    why = guards.config_refusal(NS(compilation_config=cc))
    assert "CUDA graphs (FULL_AND_PIECEWISE) and torch.compile (VLLM_COMPILE)" in why
    cc = CompilationConfig(mode=CompilationMode.NONE, cudagraph_mode=CUDAGraphMode.NONE)
    assert guards.config_refusal(NS(compilation_config=cc)) is None


@pytest.mark.parametrize("kw,named", [
    ({"spec": NS(method="ngram")}, "speculative decoding"),
    ({"dbo": True}, "dual-batch overlap"),
    ({"ubatch": 2}, "micro-batching"),
    ({"pp": 2}, "pipeline parallelism"),
    ({"runner": "pooling"}, "pooling runner"),
])
def test_runner_features_that_break_one_forward_per_step_are_one_line(kw, named):
    why = guards.config_refusal(_config(**kw))
    assert named in why and "one model forward as one step" in why and "\n" not in why


def test_cpu_data_parallelism_is_refused_naming_vllm():
    why = guards.config_refusal(_config(dp=2))
    assert why.startswith("vLLM's CPU build") and "data_parallel_size=2" in why and "all_gatherv" in why
    assert "\n" not in why
    assert guards.config_refusal(_config("cuda", dp=2)) is None     # vLLM's CUDA build dispatches with NCCL


BUILT = [("model.layers.0.mlp.experts", "RoutedExperts", True), ("model.layers.1.mlp.experts", "RoutedExperts", True)]


def test_plugin_layers_pass():
    assert guards.experts_refusal(BUILT, ("RoutedExperts",)) is None
    # a subclass the plugin does not replace is the loader's family refusal, not a bypass
    assert guards.experts_refusal([("m.layers.0.experts", "OtherExperts", False)], ("RoutedExperts",)) is None


def test_bypassed_registration_names_the_layer_and_the_env_var(monkeypatch):
    built = BUILT + [("model.layers.2.mlp.experts", "RoutedExperts", False)]
    monkeypatch.delenv("VLLM_USE_HW_AGNOSTIC", raising=False)
    why = guards.experts_refusal(built, ("RoutedExperts",))
    assert "its own RoutedExperts for 1 MoE layer(s) (model.layers.2.mlp.experts" in why
    assert "register_oot" in why and "VLLM_USE_HW_AGNOSTIC" not in why and "\n" not in why
    monkeypatch.setenv("VLLM_USE_HW_AGNOSTIC", "1")
    why = guards.experts_refusal(built, ("RoutedExperts",))
    assert "VLLM_USE_HW_AGNOSTIC=1" in why and "vllm#53153" in why and "\n" not in why
