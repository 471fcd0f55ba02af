"""docs/configuration.md is generated from the config classes (bi_core/tools/config_doc.py): it is
current, it names every key with a meaning, and the doc-only entries of the generator still name
keys that lack their own ``doc=``."""

from __future__ import annotations

from pathlib import Path

import attrs

from bi_core.config import EngineConfig
from bi_core.tools import config_doc

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def leaf_paths(obj, prefix: str = "") -> list[str]:
    """Every key of a config, walked on a built config (independent of the generator's parsers)."""
    out = []
    for f in attrs.fields(type(obj)):
        value = getattr(obj, f.name)
        if attrs.has(type(value)):
            out += leaf_paths(value, f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}")
    return out


def full_config() -> EngineConfig:
    return EngineConfig.from_dict({"model": {"random": {"preset": "tiny-dense"}}}, apply_env=False)


def test_configuration_page_is_current():
    assert PAGE.read_text() == config_doc.render(), (
        f"docs/configuration.md is stale (bi_core/config.py changed): regenerate it with `{config_doc.REGENERATE}`")


def test_a_changed_field_doc_makes_the_page_stale(monkeypatch):
    """Negative control for the test above: the comparison sees a one-key change."""
    monkeypatch.setitem(config_doc.EXTRA_DOCS, "cache.block_size", "tokens per KV page (changed)")
    assert PAGE.read_text() != config_doc.render()


def test_every_key_is_on_the_page_with_a_type_default_and_meaning():
    listed = {k.path: k for k in config_doc.keys() if isinstance(k, config_doc.Key)}
    paths = leaf_paths(full_config())
    assert sorted(listed) == sorted(paths)
    page = PAGE.read_text()
    for path in paths:
        key = listed[path]
        assert key.meaning, f"{path} has no meaning on the page: give its field a doc= in bi_core/config.py"
        assert key.type and key.default, key
        assert f"| `{path}` |" in page, path
    assert "parallel.data_parallel_size" in listed  # the key the hand-kept README reference missed


def test_extra_docs_name_keys_without_their_own_doc():
    sections = {item[0] for item in config_doc.keys() if isinstance(item, tuple)}
    keys = {k.path for k in config_doc.keys() if isinstance(k, config_doc.Key)}
    own = {k.path: k for k in config_doc.keys() if isinstance(k, config_doc.Key)}
    for path in config_doc.EXTRA_DOCS:
        assert path in keys | sections, f"config_doc.EXTRA_DOCS[{path!r}]: no such key"
        if path in keys:
            assert own[path].meaning == config_doc.EXTRA_DOCS[path], (
                f"{path} has its own doc= in bi_core/config.py now: drop config_doc.EXTRA_DOCS[{path!r}]")


def test_allowed_values_come_from_the_parsers():
    listed = {k.path: k for k in config_doc.keys() if isinstance(k, config_doc.Key)}
    assert listed["cache.kv_cache_dtype"].allowed == "auto, fp8, fp8_e4m3"
    assert listed["serve.port"].allowed == "0 .. 65535" and listed["serve.port"].type == "int"
    assert listed["cache.num_blocks"].type == "int or auto" and listed["cache.num_blocks"].default == "auto"
    assert listed["model.max_model_len"].type == "int or null"
    assert "tiny-moe" in listed["model.random.preset"].allowed
    assert "example_norm" not in listed["backend"].allowed  # built-ins only, whatever this machine installed
