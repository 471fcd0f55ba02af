"""``policy.batch_invariant`` alone sets the mode; ``backend: auto`` (the default) follows it and
the device: one backend, never a silent per-op chain. An explicit backend that contradicts
invariant mode is one ConfigError naming ``backend``, the mode and the allowed values."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import tiny_config

from bi_core import ConfigError, EngineConfig, PolicyError, build_engine
from bi_core.config import OP_NAMES
from bi_core.ops.base import OpBuilder
from bi_core.plugins import load_registry
from bi_core.policies import make_policy, planned_device
from bi_core.policies.base import auto_backend
from bi_core.registry import Backend


@pytest.mark.parametrize("invariant,device,backend", [
    (True, "cuda", "cuda_hopper_invariant"),
    (True, "cpu", "cuda_hopper_invariant"),  # the mode decides; check_config then refuses the CPU
    (False, "cuda", "cuda_default"),
    (False, "cuda:1", "cuda_default"),
    (False, "cpu", "reference"),
])
def test_auto_is_one_backend_per_mode_and_device(invariant, device, backend):
    assert auto_backend(batch_invariant=invariant, device=torch.device(device)) == backend
    policy = make_policy(batch_invariant=invariant, backend="auto", op_overrides={}, device=torch.device(device))
    assert policy.backend == backend
    assert {op: policy.order(op) for op in OP_NAMES} == {op: (backend,) for op in OP_NAMES}  # no fallback chain


def test_explicit_backend_and_per_op_overrides_are_kept():
    policy = make_policy(batch_invariant=False, backend="auto", device="cuda",
                         op_overrides={"moe": ("cuda_grouped_mm", "cuda_default")})
    assert policy.order("moe") == ("cuda_grouped_mm", "cuda_default")  # a chain the user wrote down
    assert policy.order("linear") == ("cuda_default",)
    policy = make_policy(batch_invariant=False, backend="reference", device="cuda", op_overrides={})
    assert policy.backend == "reference" and policy.order("attention") == ("reference",)


def _explain(overrides: dict, tmp_path, monkeypatch, capsys) -> str:
    """``bi-engine explain`` on a tiny config. The engine's device reaches make_policy as ``prepare``
    passes it (``device=planned_device(config.model.device)``); set here as make_policy's default
    too, so the plan is the one for the configured device whether or not ``prepare`` passes it yet."""
    from bi_core.cli import main

    cfg = tiny_config(**overrides)
    monkeypatch.setitem(make_policy.__kwdefaults__, "device", planned_device(cfg["model"]["device"]))
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    main(["explain", "--config", str(path)])
    return capsys.readouterr().out


def _ops(text: str) -> dict[str, str]:
    return {line.split("->")[0].strip(): line.split("->")[1].split()[0] for line in text.splitlines() if " -> " in line}


def test_auto_plans_reference_on_the_cpu_without_trying_cuda(tmp_path, monkeypatch, capsys):
    text = _explain({"backend": "auto"}, tmp_path, monkeypatch, capsys)
    assert set(_ops(text).values()) == {"reference"}
    assert "cuda_default" not in text and "SELECTION FAILED" not in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="plans for a CUDA device this machine does not have")
def test_auto_on_cuda_is_cuda_default_and_never_falls_back_to_reference(tmp_path, monkeypatch, capsys):
    """float32 on CUDA: cuda_default refuses attention and GDN; that is a selection error with
    cuda_default's reasons, not a silent switch of those ops to the reference backend."""
    text = _explain({"backend": "auto", "model": {"device": "cuda"}}, tmp_path, monkeypatch, capsys)
    ops = _ops(text)
    assert ops["linear"] == "cuda_default" and set(ops.values()) <= {"cuda_default", "NONE"}
    assert ops["attention"] == "NONE" and ops["gdn"] == "NONE"
    assert "reference" not in text
    assert "SELECTION FAILED" in text and "cuda_default: dtype torch.float32 not supported" in text


@pytest.mark.parametrize("backend", ["reference", "cuda_default", "cuda_grouped_mm"])
def test_explicit_backend_contradicting_invariant_mode_is_one_config_error(backend):
    with pytest.raises(ConfigError) as e:
        build_engine(EngineConfig.from_dict(tiny_config(backend=backend, policy={"batch_invariant": True})))
    assert e.value.path == "backend"
    msg = str(e.value)
    assert msg.startswith(f"backend: {backend!r} contradicts batch-invariant mode (policy.batch_invariant: true): ")
    assert "In batch-invariant mode backend is one of: auto, cuda_hopper_invariant (auto, the default, is " \
           "cuda_hopper_invariant)" in msg
    assert not isinstance(e.value, PolicyError)


def test_the_reference_backend_says_why_it_cannot_be_invariant(monkeypatch):
    monkeypatch.setenv("BI_ENABLE_BATCH_INVARIANT", "1")  # the mode set from the environment
    with pytest.raises(ConfigError, match=r"^backend: 'reference' contradicts batch-invariant mode .*: its PyTorch "
                                          r"ops \(matmul, softmax, conv\) pick kernels by shape"):
        build_engine(EngineConfig.from_dict(tiny_config()))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without an SM90 GPU")
@pytest.mark.parametrize("backend", ["auto", "cuda_hopper_invariant"])
def test_invariant_backends_pass_the_mode_check_and_reach_the_device_check(backend):
    with pytest.raises(PolicyError, match=r"batch-invariant mode needs an SM90 \(Hopper\) GPU") as e:
        build_engine(EngineConfig.from_dict(tiny_config(backend=backend, policy={"batch_invariant": True})))
    assert not isinstance(e.value, ConfigError)


class _InvariantNorm(OpBuilder):
    op = "norm"
    is_batch_invariant = True

    def build(self, spec):
        raise AssertionError("never built in these tests")


class _PlainNorm(_InvariantNorm):
    is_batch_invariant = False


def _registry_with(*backends: Backend):
    from bi_core.hookspecs import hookimpl

    class Plugin:
        @hookimpl
        def bi_register_backends(self, register):
            for backend in backends:
                register(backend)

    return load_registry(extra_plugins=(Plugin(),))


def test_allowed_values_are_the_registered_backends_that_can_serve_invariance():
    registry = _registry_with(Backend(name="plugin_invariant", builders=(_InvariantNorm(),)),
                              Backend(name="plugin_plain", builders=(_PlainNorm(),)))
    cfg = EngineConfig.from_dict(tiny_config(backend="plugin_plain", policy={"batch_invariant": True}))
    with pytest.raises(ConfigError, match=r"'plugin_plain' contradicts batch-invariant mode .*: none of its builders "
                                          r"is batch-invariant\. In batch-invariant mode backend is one of: auto, "
                                          r"cuda_hopper_invariant, plugin_invariant \("):
        build_engine(cfg, registry)
