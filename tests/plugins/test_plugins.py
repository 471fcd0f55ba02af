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
    other = md.EntryPoint(name="other_plugin", value="json", group=ENTRY_POINT_GROUP)  # a module with no hooks
    installed = md.entry_points(group=ENTRY_POINT_GROUP)
    monkeypatch.setattr(md, "entry_points", lambda group: md.EntryPoints([*installed, other]))
    monkeypatch.setenv("BI_PLUGINS", "other_plugin")
    reg = load_registry()
    assert "example_norm" not in reg.backends and "other_plugin" in [p.name for p in reg.plugins]
    monkeypatch.setenv("BI_PLUGINS", "example_norm,bi_core.backends.reference")  # a built-in's name: a no-op
    assert "example_norm" in load_registry().backends


def test_allowlist_naming_a_plugin_that_is_not_installed_is_an_error(monkeypatch):
    """It used to load no plugin at all, silently; now the error lists the installed ones."""
    monkeypatch.setenv("BI_PLUGINS", "example_nrom,example_norm")
    with pytest.raises(PluginError) as e:
        load_registry()
    assert str(e.value) == ("BI_PLUGINS: no installed plugin named 'example_nrom'; installed (entry points of group "
                            f"{ENTRY_POINT_GROUP}): example_norm")


def test_allowlist_error_from_the_cli_is_one_line(monkeypatch, capsys):
    from bi_core.cli import main

    monkeypatch.setenv("BI_PLUGINS", "nope")
    assert main(["plugins"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bi-engine: error: BI_PLUGINS: no installed plugin named 'nope'; installed") and \
        "example_norm" in err and len(err.strip().splitlines()) == 1


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


class RaisesInHook:
    @hookimpl
    def bi_register_strategies(self, register):
        raise ValueError("no strategy today")


def test_a_hook_that_raises_names_the_plugin_and_the_hook():
    with pytest.raises(PluginError) as e:
        load_registry(extra_plugins=(RaisesInHook(),))
    assert str(e.value) == ("plugin 'RaisesInHook' (registered in process) raised in hook bi_register_strategies: "
                            "ValueError: no strategy today")


def test_an_entry_point_hook_that_raises_names_its_package(monkeypatch):
    import bi_example_backend

    @hookimpl
    def bi_register_backends(register):
        register(Backend(name="broken", builders=(bi_example_backend.TorchNormBuilder(),) * 2))

    monkeypatch.setattr(bi_example_backend, "bi_register_backends", bi_register_backends)
    with pytest.raises(PluginError) as e:
        load_registry()
    assert str(e.value).startswith("plugin 'example_norm' (package bi-engine-example-backend 0.1.0), hook "
                                   "bi_register_backends: backend 'broken': more than one builder for an op")


def _norm_config(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {random: {preset: tiny-dense, seed: 0}, dtype: float32, device: cpu, max_model_len: 64}\n"
                    "backend: reference\npolicy: {ops: {norm: [example_norm, reference]}}\n")
    return path


@pytest.mark.parametrize("method", ["check", "build"])
def test_a_builder_that_raises_names_the_plugin_backend_and_method(method, monkeypatch, tmp_path, capsys):
    """From the Python API a PluginError; from the CLI one line, exit 2 (was a bare traceback)."""
    import bi_example_backend

    from bi_core.cli import main

    def boom(self, *args):
        raise RuntimeError("boom")

    monkeypatch.setattr(bi_example_backend.TorchNormBuilder, method, boom)
    message = (f"plugin 'example_norm' (package bi-engine-example-backend 0.1.0), backend 'example_norm', "
               f"TorchNormBuilder.{method} raised RuntimeError: boom")
    with pytest.raises(PluginError) as e:
        build_engine(EngineConfig.from_yaml(_norm_config(tmp_path)))
    assert str(e.value) == message
    assert main(["run", "--config", str(_norm_config(tmp_path)), "--prompt-ids", "1,2", "--max-new-tokens", "1"]) == 2
    assert capsys.readouterr().err == f"bi-engine: error: {message}\n"


def test_a_check_that_returns_no_list_is_named(monkeypatch):
    import bi_example_backend

    monkeypatch.setattr(bi_example_backend.TorchNormBuilder, "check", lambda self, spec, policy: "too wide")
    cfg = EngineConfig.from_dict(tiny_config(policy={"ops": {"norm": ["example_norm", "reference"]}}))
    with pytest.raises(PluginError, match=r"backend 'example_norm', TorchNormBuilder.check returned 'too wide'; "
                                          "check must return a list of reason strings"):
        build_engine(cfg)
