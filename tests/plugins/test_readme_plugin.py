"""The README's "Write a plugin" snippet runs as written: its module registers a backend
the engine selects and runs, and its entry-point table names our entry-point group."""

from __future__ import annotations

import re
import sys
import tomllib
import types
from pathlib import Path

from helpers import tiny_config

from bi_core import EngineConfig, SamplingParams, build_engine
from bi_core.plugins import ENTRY_POINT_GROUP, load_registry

README = Path(__file__).parents[2] / "README.md"


def readme_plugin_blocks() -> dict[str, str]:
    """The fenced code blocks of the README's plugin section, by language (python, toml)."""
    text = README.read_text()
    section = text.split("## Write a plugin", 1)[1].split("\n## ", 1)[0]
    blocks = dict(re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S))
    assert set(blocks) == {"python", "toml"}, f"the plugin section's code blocks changed: {sorted(blocks)}"
    return blocks


def snippet_module(monkeypatch) -> types.ModuleType:
    """The python block run as the module its entry point names (``my_package``)."""
    blocks = readme_plugin_blocks()
    entry_points = tomllib.loads(blocks["toml"])["project"]["entry-points"]
    assert list(entry_points) == [ENTRY_POINT_GROUP]
    (_, module_name), = entry_points[ENTRY_POINT_GROUP].items()
    module = types.ModuleType(module_name)
    monkeypatch.setitem(sys.modules, module_name, module)
    exec(compile(blocks["python"], f"README.md ({module_name})", "exec"), module.__dict__)  # noqa: S102 (our README)
    return module


def test_readme_plugin_snippet_registers_a_backend_the_engine_runs(monkeypatch):
    from bi_core.runtime.build import explain

    registry = load_registry(extra_plugins=(snippet_module(monkeypatch),))
    assert "my_backend" in registry.backends
    cfg = EngineConfig.from_dict(tiny_config(policy={"ops": {"norm": ["my_backend", "reference"]}}))
    assert "norm          -> my_backend" in explain(cfg, registry)
    engine = build_engine(cfg, registry)
    norms = {type(m.impl).__name__ for m in engine.model.modules() if type(m).__name__ == "RMSNorm"}
    assert norms == {"MyNormImpl"}
    prompt, params = [[1, 2, 3, 4]], SamplingParams(max_new_tokens=6, ignore_eos=True)
    ours = engine.generate(prompt, params)[0]
    ref = build_engine(EngineConfig.from_dict(tiny_config()), registry).generate(prompt, params)[0]
    assert len(ours.token_ids) == 6 and ours.token_ids == ref.token_ids


def test_readme_plugin_snippet_check_refuses_with_its_reason(monkeypatch):
    """bfloat16 activations: the snippet's check says why, and norm falls through to the reference."""
    from bi_core.runtime.build import explain

    registry = load_registry(extra_plugins=(snippet_module(monkeypatch),))
    cfg = EngineConfig.from_dict(tiny_config(model={"dtype": "bfloat16"},
                                             policy={"ops": {"norm": ["my_backend", "reference"]}}))
    text = explain(cfg, registry)
    assert "norm          -> reference" in text and "refused my_backend: float32 activations only" in text
