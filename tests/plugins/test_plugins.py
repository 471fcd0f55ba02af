"""Plugins: the example package installs through its entry point and is picked from YAML; every
hook registers what it should; a misspelled hook is an error."""

from __future__ import annotations

import importlib.metadata as md

import pytest
from helpers import tiny_config

from bi_core import EngineConfig, PluginError, SamplingParams, build_engine, hookimpl
from bi_core.plugins import ENTRY_POINT_GROUP, load_registry
from bi_core.registry import Backend
from bi_core.strategies.ar import ARStrategy


def test_example_plugin_is_installed_through_its_entry_point():
    names = [ep.name for ep in md.entry_points(group=ENTRY_POINT_GROUP)]
    assert "example_norm" in names, "pip install ./plugins/bi-engine-example-backend (the README's test command does)"
    reg = load_registry()
    assert "example_norm" in reg.backends and reg.owners["example_norm"] == "example_norm"
    info = next(p for p in reg.plugins if p.name == "example_norm")
    assert info.distribution == "bi-engine-example-backend" and info.version == "0.1.0"


def test_example_plugin_selected_from_yaml(tmp_path):
    from bi_core.runtime.build import explain

    path = tmp_path / "c.yaml"
    path.write_text("model: {random: {preset: tiny-moe, seed: 0}, dtype: float32, device: cpu, max_model_len: 256}\n"
                    "backend: reference\npolicy: {ops: {norm: [example_norm, reference]}}\n")
    cfg = EngineConfig.from_yaml(path)
    text = explain(cfg)
    assert "norm          -> example_norm" in text
    ours = build_engine(cfg).generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
    ref = build_engine(EngineConfig.from_yaml(path).replace(policy={"ops": {}})).generate(
        [[1, 2, 3, 4]], SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
    assert ours.token_ids == ref.token_ids


def test_a_builder_never_gets_a_spec_form_it_did_not_declare():
    """The example plugin's norm builder predates the norm's block-FP8 output copy (``NormSpec.fp8_group``)
    and does not declare it (``NormBuilder.fp8_output``): on an FP8 model the norms feeding FP8
    projections fall through to the next backend, with the contract's reason in ``explain``, and
    the plain norms (the final one) stay with the plugin; the engine runs."""
    from bi_core.runtime.build import explain

    cfg = EngineConfig.from_dict(tiny_config(model={"random": {"preset": "tiny-moe-b128", "seed": 0}, "quantization": "fp8"},
                                             policy={"ops": {"norm": ["example_norm", "reference"]}}))
    text = explain(cfg)
    assert "norm          -> example_norm, reference" in text
    assert "refused example_norm: norm with a block-FP8 output copy (groups of 128): no kernel in bi_example_backend yet" \
        in text
    engine = build_engine(cfg)
    norms = {type(m.impl).__name__ for m in engine.model.modules() if type(m).__name__ == "RMSNorm"}
    assert len(norms) == 2 and "ReferenceRMSNormImpl" in norms
    out = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


class NarrowNorm:
    """A plugin whose norm builder refuses some specs: explain shows its reasons, and the selector
    falls through to the next backend in the policy's order for those specs only."""

    @hookimpl
    def bi_register_backends(self, register):
        from bi_core.backends.reference.norm import ReferenceNormBuilder

        class Narrow(ReferenceNormBuilder):
            def check(self, spec, policy):
                return [f"rows of {spec.hidden_size} are wider than 32"] if spec.hidden_size > 32 else []

        register(Backend(name="narrow_norm", builders=(Narrow(),)))


def test_refusals_are_explained_and_fall_through(tmp_path):
    from bi_core.runtime.build import explain

    cfg = EngineConfig.from_dict(tiny_config(policy={"ops": {"norm": ["narrow_norm", "reference"]}}))
    registry = load_registry(extra_plugins=(NarrowNorm(),))
    text = explain(cfg, registry)
    assert "norm          -> reference" in text
    assert "refused narrow_norm: rows of 64 are wider than 32" in text
    ours = build_engine(cfg, registry).generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, ignore_eos=True))[0]
    assert len(ours.token_ids) == 4


def test_disable_and_allowlist(monkeypatch):
    monkeypatch.setenv("BI_DISABLE_PLUGINS", "example_norm")
    assert "example_norm" not in load_registry().backends
    monkeypatch.delenv("BI_DISABLE_PLUGINS")
    monkeypatch.setenv("BI_PLUGINS", "something_else")
    assert "example_norm" not in load_registry().backends
    monkeypatch.setenv("BI_PLUGINS", "example_norm")
    assert "example_norm" in load_registry().backends


class Misspelled:
    @hookimpl
    def bi_register_backend(self, register):  # missing the final "s"
        pass


def test_misspelled_hook_is_an_error():
    with pytest.raises(PluginError, match="implements a hook that does not exist"):
        load_registry(extra_plugins=(Misspelled(),))


class Registers:
    @hookimpl
    def bi_register_backends(self, register):
        register(Backend(name="empty_backend", builders=()))

    @hookimpl
    def bi_register_strategies(self, register):
        class Greedy2(ARStrategy):
            name = "ar2"

        register(Greedy2)


def test_each_hook_registers():
    reg = load_registry(extra_plugins=(Registers(),))
    assert "empty_backend" in reg.backends and "ar2" in reg.strategies
    eng = build_engine(EngineConfig.from_dict(tiny_config(strategy={"name": "ar2"})), reg)
    assert eng.generate([[1, 2]], SamplingParams(max_new_tokens=2))[0].finish_reason in ("length", "stop")


def test_duplicate_names_are_errors():
    class Dup:
        @hookimpl
        def bi_register_backends(self, register):
            register(Backend(name="reference", builders=()))

    with pytest.raises(PluginError, match="backend 'reference' registered twice"):
        load_registry(extra_plugins=(Dup(),))
