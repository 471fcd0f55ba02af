"""Adapter-only weight sync: a name's new version (from disk, from tensors, by shared-memory
handles) serves the requests admitted after it, while those admitted before finish on theirs,
bitwise as if the swap never happened; slots free when the last request of a version ends;
max_loras full is one clear error; adapters that cannot be served are refused by name."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from lora_fixtures import random_adapter, save_adapter  # noqa: E402

from bi_core import EngineConfig, SamplingParams, build_engine  # noqa: E402
from bi_core.errors import CheckpointError, ConfigError, LoraError, RequestError  # noqa: E402
from bi_core.rl import serialize_named_tensors  # noqa: E402

PROMPTS = [[(5 * i + j) % 250 for j in range(n)] for i, n in enumerate((7, 19, 33, 4))]


def engine(max_loras: int = 3, **lora):
    return build_engine(EngineConfig.from_dict({
        "model": {"random": {"preset": "tiny-moe", "seed": 1, "num_hidden_layers": 2}, "dtype": "float32",
                  "device": "cpu", "max_model_len": 128},
        "backend": "reference", "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 64},
        "cache": {"block_size": 16, "num_blocks": 64}, "lora": {"max_loras": max_loras, "max_rank": 16, **lora}}))


def params(n: int = 6, lora: str | None = "pol") -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True, logprobs=1, lora_name=lora)


def run(swap: bool, late_on: str = "new") -> tuple[list, list, object]:
    """Two requests start on the first version; after 3 steps the second version arrives and four
    more requests run beside them. ``swap``: both versions under one name ("pol": v2 loaded in
    place, by shared-memory handles, while v1 serves); else two names loaded from the start
    ("old", "new"), the same slots: what a request pinning its version must equal."""
    eng = engine()
    cfg, t1 = random_adapter(eng, r=8, seed=1, scale=2.0)
    _, t2 = random_adapter(eng, r=8, seed=2, scale=2.0)
    eng.load_lora_adapter("pol" if swap else "old", tensors=t1, config=cfg)
    if not swap:
        eng.load_lora_adapter("new", tensors=t2, config=cfg)
    early = [eng.add_request(p, params(lora="pol" if swap else "old")) for p in PROMPTS[:2]]
    for _ in range(3):
        eng.step()
    assert all(s.output_ids for s in early) and not any(s.finish_reason for s in early)  # mid-decode
    if swap:
        second = eng.load_lora_adapter_from_tensor("pol", serialize_named_tensors(t2), cfg)
        assert (second.version, second.slot) == (2, 1)
    late = [eng.add_request(p, params(lora="pol" if swap else late_on)) for p in PROMPTS]
    while eng.has_work():
        eng.step()
    return [eng.output_of(s) for s in early], [eng.output_of(s) for s in late], eng


def bits(outs) -> list:
    return [(o.token_ids, o.token_logprobs) for o in outs]


def test_version_swap_under_load():
    """Requests on v1 are mid-decode when v2 lands; requests admitted then run on v2 beside them.
    Each finishes with its own version's tokens and logprobs, bitwise those of two adapters
    loaded side by side; v1's slot is freed once its last request ends. Negative control: the
    late requests on v1 instead give other bits."""
    early, late, eng = run(swap=True)
    want_early, want_late, _ = run(swap=False)
    assert bits(early) == bits(want_early) and bits(late) == bits(want_late)
    _, on_old, _ = run(swap=False, late_on="old")
    assert bits(on_old) != bits(late)
    assert 0 in eng.lora.free and not eng.lora.retired and eng.lora.current["pol"].version == 2


def test_from_disk_prefix_cache_and_base_rows(tmp_path):
    """A version loaded from a PEFT directory equals the same tensors pushed in memory; the prefix
    cache never hands a request pages computed with another adapter (or version, or none)."""
    eng = engine()
    cfg, tensors = random_adapter(eng, r=8, seed=3, scale=2.0)
    eng.load_lora_adapter("mem", tensors=tensors, config=cfg)
    eng.load_lora_adapter("disk", save_adapter(tmp_path / "a", cfg, tensors))
    prompt = list(range(1, 40))
    mem, disk = eng.generate([prompt, prompt], [params(lora="mem"), params(lora="disk")])
    assert mem.token_logprobs == disk.token_logprobs
    base = eng.generate([prompt], [params(lora=None)])[0]
    assert base.token_logprobs != mem.token_logprobs


def test_slots_full_and_refusals():
    eng = engine(max_loras=1)
    cfg, tensors = random_adapter(eng, r=8, seed=1)
    eng.load_lora_adapter("a", tensors=tensors, config=cfg)
    seq = eng.add_request(PROMPTS[0], params(lora="a"))
    eng.step()
    with pytest.raises(LoraError, match=r"all lora.max_loras=1 slots are taken \(a v1"):
        eng.load_lora_adapter("a", tensors=tensors, config=cfg)  # v1 still serves a request
    while eng.has_work():
        eng.step()
    assert seq.finish_reason == "length"
    eng.load_lora_adapter("a", tensors=tensors, config=cfg)  # its request ended: the slot is free again
    with pytest.raises(RequestError, match="unknown LoRA adapter 'b'"):
        eng.add_request(PROMPTS[0], params(lora="b"))
    with pytest.raises(CheckpointError, match="rank 32 exceeds lora.max_rank=16"):
        eng.load_lora_adapter("a", tensors=random_adapter(eng, r=32)[1], config={"r": 32, "lora_alpha": 32})
    experts = {"base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_A.weight": torch.zeros(4, 64),
               "base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_B.weight": torch.zeros(32, 4)}
    with pytest.raises(CheckpointError, match="experts.0.gate_proj .no adaptable projection"):
        eng.load_lora_adapter("x", tensors=experts, config=cfg)
    with pytest.raises(CheckpointError, match="use_dora"):
        eng.load_lora_adapter("x", tensors=tensors, config={**cfg, "use_dora": True})
    with pytest.raises(LoraError, match="no LoRA adapter named 'zzz'"):
        eng.unload_lora_adapter("zzz")
    off = engine(max_loras=0)
    with pytest.raises(LoraError, match="LoRA is off"):
        off.load_lora_adapter("a", tensors=tensors, config=cfg)
    (refused,) = off.generate([PROMPTS[0]], [params(lora="a")])
    assert refused.finish_reason == "error" and "lora.max_loras is 0" in refused.error
    with pytest.raises(ConfigError, match="lora.adapters"):
        EngineConfig.from_dict({"model": {"random": {"preset": "tiny-dense"}}, "lora": {"adapters": {"a": "/x"}}})


def test_scoring_under_an_adapter_and_tensor_parallel_refused():
    """``score(..., lora_name=)`` gives the logprobs the adapter sampled with (exact scoring, greedy
    tokens): equal to generation's on the same engine; the base model's differ."""
    eng = engine()
    cfg, tensors = random_adapter(eng, r=8, seed=5, scale=2.0)
    eng.load_lora_adapter("a", tensors=tensors, config=cfg)
    (out,) = eng.generate([PROMPTS[1]], [params(lora="a")])
    (scored,) = eng.score([PROMPTS[1]], [out.token_ids], lora_name="a")
    (base,) = eng.score([PROMPTS[1]], [out.token_ids])
    torch.testing.assert_close(torch.tensor(scored.token_logprobs), torch.tensor(out.token_logprobs), atol=1e-5, rtol=0)
    assert base.token_logprobs != scored.token_logprobs
    cfg_tp = EngineConfig.from_dict({"model": {"random": {"preset": "tiny-dense"}, "device": "cpu"},
                                     "parallel": {"tensor_parallel_size": 2}, "lora": {"max_loras": 1}})
    with pytest.raises(ConfigError, match="lora.max_loras: LoRA adapters are not served with tensor parallelism"):
        build_engine(cfg_tp)
