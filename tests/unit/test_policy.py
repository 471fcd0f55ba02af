"""Mode refusals happen before anything is loaded, each with one clear message."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config

from bi_core import (
    BackendSelectionError,
    BatchInvarianceUnsupported,
    ConfigError,
    EngineConfig,
    PolicyError,
    build_engine,
)
from bi_core.ops.base import OpBuilder
from bi_core.plugins import load_registry
from bi_core.registry import Backend


def build(**overrides):
    return build_engine(EngineConfig.from_dict(tiny_config(**overrides)))


def test_reference_refuses_invariance_with_one_config_error():
    with pytest.raises(ConfigError) as e:
        build(policy={"batch_invariant": True})
    assert e.value.path == "backend"
    assert str(e.value).startswith("backend: 'reference' contradicts batch-invariant mode")


def test_reference_named_per_op_refuses_invariance_with_dedicated_error():
    with pytest.raises(BatchInvarianceUnsupported) as e:
        build(policy={"batch_invariant": True, "ops": {"norm": ["reference"]}}, backend="auto")
    assert e.value.backend == "reference"
    assert str(e.value).startswith("backend 'reference' does not support batch-invariant mode:")


def test_env_invariance_reaches_the_reference_refusal(monkeypatch):
    monkeypatch.setenv("BI_ENABLE_BATCH_INVARIANT", "1")
    with pytest.raises(ConfigError, match="'reference' contradicts batch-invariant mode"):
        build()


@pytest.mark.parametrize("policy,message", [
    ({"batch_invariant": True, "expert_parallel_size": 2}, "policy.expert_parallel_size: batch-invariant mode needs 1"),
    ({"batch_invariant": True, "eplb": True}, "policy.eplb: batch-invariant mode refuses EPLB"),
])
def test_invariance_refuses_ep_and_eplb(policy, message):
    with pytest.raises(PolicyError, match=message):
        build(policy=policy, backend="auto")


@pytest.mark.parametrize("policy,message", [
    ({"expert_parallel_size": 2}, "policy.expert_parallel_size: expert parallelism is not implemented yet; use 1"),
    ({"eplb": True}, "policy.eplb: expert-parallel load balancing (EPLB) is not implemented yet; use false"),
])
def test_default_mode_refuses_ep_and_eplb_until_they_exist(policy, message):
    from bi_core.runtime.build import explain

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build(policy=policy)
    with pytest.raises(ConfigError, match="not implemented yet"):
        explain(EngineConfig.from_dict(tiny_config(policy=policy)))


class _InvariantNorm(OpBuilder):
    op = "norm"
    is_batch_invariant = True

    def build(self, spec):
        raise AssertionError("never built in these tests")


def _invariant_plugin():
    from bi_core.hookspecs import hookimpl

    class Plugin:
        @hookimpl
        def bi_register_backends(self, register):
            register(Backend(name="fake_invariant", builders=(_InvariantNorm(),)))

    return Plugin()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without an SM90 GPU")
def test_invariance_needs_hopper():
    registry = load_registry(extra_plugins=(_invariant_plugin(),))
    cfg = EngineConfig.from_dict(tiny_config(backend="fake_invariant", policy={"batch_invariant": True}))
    with pytest.raises(PolicyError, match=r"batch-invariant mode needs an SM90 \(Hopper\) GPU; model.device resolves to cpu"):
        build_engine(cfg, registry)


def test_unregistered_backend_fails_with_selector_table():
    with pytest.raises(BackendSelectionError) as e:
        build(backend="cuda_future")
    msg = str(e.value)
    assert "no backend can serve op" in msg and "cuda_future: backend not registered (registered: " in msg
    assert "reference" in msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("backend", ["cuda_default", "cuda_hopper_invariant"])
def test_cuda_backends_refuse_the_cpu_with_reasons(backend):
    with pytest.raises(BackendSelectionError, match=f"{backend}: needs a CUDA device, spec is on cpu"):
        build(backend=backend)


def test_graphs_on_reference_are_refused_with_reason():
    """CUDA graphs cannot capture the reference backend's impls: refused, naming the key (an
    explain of a CUDA config, on any machine); off a CUDA device, capturing is refused too."""
    from bi_core.runtime.build import explain

    text = explain(EngineConfig.from_dict(tiny_config(model={"device": "cuda"}, graph={"enabled": True})))
    assert ("SELECTION FAILED:\ngraph.enabled: CUDA graphs cannot capture this model's impls (backend 'reference': "
            "its impls read the step's host lists") in text
    with pytest.raises(ConfigError, match="graph.capture: CUDA graphs need a CUDA device; model.device resolves to cpu"):
        build(graph={"enabled": True, "capture": True})


def test_unknown_strategy_and_misplaced_option():
    with pytest.raises(ConfigError, match="strategy.name: unknown strategy 'beam'; registered: ar"):
        build(strategy={"name": "beam"})
    with pytest.raises(ConfigError, match="strategy.num_speculative_tokens: only for speculative strategies"):
        build(strategy={"name": "ar", "num_speculative_tokens": 2})


def test_max_model_len_beyond_model_and_cache_too_small():
    with pytest.raises(ConfigError, match="model.max_model_len: 99999 exceeds the model's max_position_embeddings 4096"):
        build(model={"max_model_len": 99999})
    with pytest.raises(ConfigError, match="cache.num_blocks: the KV cache holds 32 tokens"):
        build(cache={"num_blocks": 2})
