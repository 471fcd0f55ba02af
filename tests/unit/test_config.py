"""Every config error class gives one error that names the key path."""

from __future__ import annotations

import pytest
from helpers import tiny_config

from bi_core import ConfigError, EngineConfig


def err(data) -> str:
    with pytest.raises(ConfigError) as e:
        EngineConfig.from_dict(data)
    return str(e.value)


def test_valid_config_roundtrip():
    cfg = EngineConfig.from_dict(tiny_config())
    assert cfg.scheduler.max_num_seqs == 8 and cfg.model.random.preset == "tiny-dense"
    assert cfg.policy.batch_invariant is False


@pytest.mark.parametrize("data,message", [
    (tiny_config(scheduler={"max_num_seqs": -3}), "scheduler.max_num_seqs: expected a positive int, got -3"),
    (tiny_config(scheduler={"max_num_seqs": "8"}), "scheduler.max_num_seqs: expected an int, got str '8'"),
    (tiny_config(scheduler={"max_num_seqs": True}), "scheduler.max_num_seqs: expected an int, got bool"),
    (tiny_config(schedular={}), "schedular: unknown key; allowed keys here: model, policy, backend"),
    (tiny_config(cache={"blok_size": 16}), "cache.blok_size: unknown key; allowed keys here: block_size"),
    (tiny_config(model={"dtype": "float16"}), "model.dtype: expected one of float32, bfloat16; got 'float16'"),
    (tiny_config(model={"random": {"preset": "huge"}}), "model.random.preset: unknown preset 'huge'"),
    (tiny_config(model={"path": "/x"}), "model: set exactly one of model.path"),
    (tiny_config(model={"device": "tpu"}), "model.device: expected auto, cpu, cuda or cuda:N; got 'tpu'"),
    (tiny_config(policy={"batch_invariant": "yes"}), "policy.batch_invariant: expected true or false"),
    (tiny_config(policy={"ops": {"atention": ["reference"]}}), "policy.ops.atention: unknown op; expected one of"),
    (tiny_config(policy={"ops": {"norm": []}}), "policy.ops.norm: expected a non-empty list of names"),
    (tiny_config(cache={"num_blocks": 0}), "cache.num_blocks: expected a positive int, got 0"),
    (tiny_config(cache={"num_blocks": "many"}), "cache.num_blocks: expected an int, got str 'many'"),
    (tiny_config(scheduler={"prefill_chunk_size": 1000}), "scheduler.prefill_chunk_size: must not exceed"),
    (tiny_config(strategy={"num_speculative_tokens": 9}), "strategy.num_speculative_tokens: expected an int <= 4, got 9"),
    (tiny_config(sampling={"top_p": 1.5}), "sampling.top_p: expected a number in (0.0, 1.0], got 1.5"),
    (tiny_config(sampling={"top_p": 0.0}), "sampling.top_p: expected a number in (0.0, 1.0], got 0.0"),
    (tiny_config(sampling={"temperature": "1e-3"}), "sampling.temperature: expected a number, got str '1e-3' "
                                                    "(YAML reads 1e-3 as a string; write it with a dot"),
    (tiny_config(sampling={"temperature": 10 ** 400}), "sampling.temperature: expected a number in [0.0, 100.0]"),
    (tiny_config(sampling={"seed": 2 ** 64}), "sampling.seed: expected a seed in [0, 2**64 - 1]"),
    (tiny_config(seed=2 ** 70), "seed: expected a seed in [0, 2**64 - 1] (random draws are keyed by 64 bits), got "
                                f"{2 ** 70}"),
    (tiny_config(model={"random": {"seed": 2 ** 64}}), "model.random.seed: expected a seed in [0, 2**64 - 1]"),
    (tiny_config(prompts=["ok", []]), "prompts[1]: expected a non-empty string or a non-empty list of token ids"),
    (tiny_config(prompts="hello"), "prompts: expected a list of prompts, got str"),
    ({"backend": "reference"}, "model: missing required section"),
    (tiny_config(model=None), "model: missing required section"),
])
def test_config_errors_name_the_key(data, message):
    if data.get("model") is None:
        data = {k: v for k, v in data.items() if k != "model"}
    assert message in err(data)


def test_missing_checkpoint_files(tmp_path):
    base = tiny_config()
    base["model"] = {"path": str(tmp_path / "nope")}
    assert "model.path: checkpoint directory" in err(base) and "does not exist" in err(base)
    base["model"] = {"path": str(tmp_path)}
    assert err(base) == f"model.path: no config.json in {tmp_path}"
    (tmp_path / "config.json").write_text("{}")
    assert err(base) == f"model.path: no *.safetensors files in {tmp_path}"


def test_yaml_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        EngineConfig.from_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        EngineConfig.from_yaml(bad)
    top = tmp_path / "list.yaml"
    top.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="model: missing required section"):
        EngineConfig.from_yaml(top)


def test_env_turns_invariance_on_and_rejects_garbage(monkeypatch):
    monkeypatch.setenv("BI_ENABLE_BATCH_INVARIANT", "1")
    assert EngineConfig.from_dict(tiny_config()).policy.batch_invariant is True
    monkeypatch.setenv("BI_ENABLE_BATCH_INVARIANT", "0")
    assert EngineConfig.from_dict(tiny_config(policy={"batch_invariant": True})).policy.batch_invariant is False
    monkeypatch.setenv("BI_ENABLE_BATCH_INVARIANT", "yes")
    assert "BI_ENABLE_BATCH_INVARIANT: expected 0 or 1, got 'yes'" in err(tiny_config())


def test_shipped_configs_parse():
    from pathlib import Path

    root = Path(__file__).parents[2]
    paths = sorted([*root.joinpath("configs").glob("*.yaml"), *root.joinpath("benchmarks", "configs").glob("*.yaml")])
    assert len(paths) >= 9
    for path in paths:
        EngineConfig.from_yaml(path)


def test_config_file_errors_are_one_line_naming_the_file(tmp_path):
    binary = tmp_path / "model.safetensors"
    binary.write_bytes(b"\x89PNG\x00\xff\xfe")
    with pytest.raises(ConfigError, match=r"is not UTF-8 text \(byte 0x89 at offset 0\); pass a YAML file"):
        EngineConfig.from_yaml(binary)
    with pytest.raises(ConfigError, match="is a directory; pass a YAML file"):
        EngineConfig.from_yaml(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  random: {preset: tiny-dense\nbackend: reference\n")
    with pytest.raises(ConfigError) as e:
        EngineConfig.from_yaml(bad)
    assert str(e.value) == (f"{bad} is not valid YAML: line 3, column 8: expected ',' or '}}', but got ':' "
                            "(while parsing a flow mapping at line 2, column 11)")
    bad.write_text("model: {random: {preset: tiny-dense}}\nbackend: \x01\n")
    with pytest.raises(ConfigError) as e:
        EngineConfig.from_yaml(bad)
    assert str(e.value) == f"{bad} is not valid YAML: line 2, column 10: special characters are not allowed " \
                           "(character #x0001)"


def test_a_tokenizer_that_does_not_load_is_a_config_error(tmp_path):
    from bi_core import build_engine

    assert err(tiny_config(model={"tokenizer": str(tmp_path / "nonexistent")})) == \
        f"model.tokenizer: tokenizer directory {tmp_path / 'nonexistent'} does not exist"
    assert err(tiny_config(model={"tokenizer": str(tmp_path)})) == \
        f"model.tokenizer: no tokenizer files (tokenizer.json, tokenizer_config.json, vocab.json) in {tmp_path}"
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match=f"model.tokenizer: tokenizer in {tmp_path} cannot be loaded: "):
        build_engine(EngineConfig.from_dict(tiny_config(model={"tokenizer": str(tmp_path)})))


def test_to_dict_round_trips_through_from_dict():
    cfg = EngineConfig.from_dict(tiny_config(policy={"batch_invariant": False}, parallel={"data_parallel_size": 3}))
    data = cfg.to_dict()
    assert data["parallel"]["data_parallel_size"] == 3 and isinstance(data["model"], dict)
    assert EngineConfig.from_dict(data) == cfg


def test_every_float_key_refuses_nan_and_inf():
    """NaN compared false with both bounds, so it passed the range check (serve.shutdown_timeout_s: .nan).
    Every float field of every config section, new ones included as they are added."""
    import attrs

    import bi_core.config as config

    sections = [obj for obj in vars(config).values() if isinstance(obj, type) and attrs.has(obj)]
    keys = [(cls, f) for cls in sections for f in attrs.fields(cls) if f.type in ("float", "float | None")]
    assert {"SamplingConfig.temperature", "SamplingConfig.top_p", "CacheConfig.gpu_memory_utilization",
            "ServeConfig.shutdown_timeout_s"} <= {f"{cls.__name__}.{f.name}" for cls, f in keys}
    for cls, f in keys:
        for value in (float("nan"), float("inf"), float("-inf")):
            with pytest.raises(ConfigError, match="^k: expected a finite number") as e:
                f.metadata["parse"](value, "k")
            assert str(value) in str(e.value), (cls, f.name)


def test_nan_in_a_yaml_file_names_the_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {random: {preset: tiny-dense}}\nserve: {shutdown_timeout_s: .nan}\n")
    with pytest.raises(ConfigError) as e:
        EngineConfig.from_yaml(path)
    assert str(e.value) == "serve.shutdown_timeout_s: expected a finite number in [0.0, 3600.0], got nan"


def test_the_largest_seed_is_taken():
    cfg = EngineConfig.from_dict(tiny_config(seed=2 ** 64 - 1, sampling={"seed": 2 ** 64 - 1}))
    assert cfg.seed == cfg.sampling.seed == 2 ** 64 - 1


@pytest.mark.parametrize("text,key,where", [
    ("model: {random: {preset: tiny-dense}}\nbackend: reference\nbackend: cuda_default\n", "backend", "lines 2 and 3"),
    ("model:\n  random: {preset: tiny-dense}\n  dtype: float32\n  random: {preset: tiny-moe}\n", "model.random",
     "lines 2 and 4"),
    ("model: {random: {preset: tiny-dense}}\nsampling: {seed: 1, seed: 2}\n", "sampling.seed",
     "line 2, columns 12 and 21"),
    ("model: {random: {preset: tiny-dense}}\nprompts:\n  - [1, 2]\n  - {a: 1, a: 2}\n", "prompts[1].a",
     "line 4, columns 6 and 12"),
    ("model: {random: {preset: tiny-dense}}\nscheduler:\n  8: 1\n  0x8: 2\n", "scheduler.8", "lines 3 and 4"),
])
def test_a_key_given_twice_is_refused_with_both_lines(tmp_path, text, key, where):
    """YAML keeps the last of two equal keys; a config that says one thing twice is refused."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        EngineConfig.from_yaml(path)
    assert str(e.value) == f"{key}: given twice in {path} ({where}); YAML would silently keep the last one, so keep " \
                           "one of them"


def test_a_merge_key_may_be_overridden(tmp_path):
    """'<<: *base' then a key of its own: YAML's override, not a duplicate."""
    path = tmp_path / "c.yaml"
    path.write_text("model: {random: {preset: tiny-dense}}\nscheduler:\n  <<: &s {max_num_seqs: 4, "
                    "max_num_batched_tokens: 64}\n  max_num_seqs: 2\n")
    assert EngineConfig.from_yaml(path).scheduler.max_num_seqs == 2
