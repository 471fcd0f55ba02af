"""The example strategy package (plugins/bi-engine-example-strategy), not installed: its module is
loaded through the entry point its pyproject declares and registered with the plugin manager. It
decodes exactly as the built-in ``ar`` (tokens and logprobs, greedy and seeded, n samples, prompt
logprobs), bitwise on the reference backend."""

from __future__ import annotations

import importlib.metadata as md
import tomllib
from pathlib import Path

import pytest
from helpers import tiny_config

from bi_core import EngineConfig, SamplingParams, build_engine
from bi_core.plugins import ENTRY_POINT_GROUP, load_registry

PACKAGE = Path(__file__).resolve().parents[2] / "plugins" / "bi-engine-example-strategy"
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 40))]


@pytest.fixture
def registry(monkeypatch):
    """The registry with the example package registered as its entry point would load it."""
    project = tomllib.loads((PACKAGE / "pyproject.toml").read_text())["project"]
    [(name, value)] = project["entry-points"][ENTRY_POINT_GROUP].items()
    monkeypatch.syspath_prepend(str(PACKAGE))
    plugin = md.EntryPoint(name=name, value=value, group=ENTRY_POINT_GROUP).load()
    return load_registry(extra_plugins=(plugin,))


def _run(registry, strategy: str, seed: int = 7) -> list:
    engine = build_engine(EngineConfig.from_dict(tiny_config(model={"random": {"preset": "tiny-moe", "seed": 0}},
                                                             strategy={"name": strategy})), registry)
    greedy = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=2))
    sampled = engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=10, temperature=1.0, seed=seed, n=2,
                                                          ignore_eos=True, logprobs=1))
    return [(o.token_ids, o.token_logprobs, o.logprobs, o.prompt_logprobs) for o in greedy] + \
        [(s.token_ids, s.token_logprobs) for group in sampled for s in group.outputs]


def test_the_example_strategy_registers_through_its_entry_point(registry):
    assert "example_ar" in registry.strategies and registry.owners["s:example_ar"] == "bi_example_strategy"


def test_the_example_strategy_decodes_as_ar_bitwise(registry):
    ours = _run(registry, "example_ar")
    assert ours == _run(registry, "ar")
    # negative control: the comparison sees a change in the sampled tokens (another seed)
    assert ours != _run(registry, "example_ar", seed=8)
