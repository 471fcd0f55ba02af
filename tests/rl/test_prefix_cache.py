"""Prefix caching: a request served from cached chunks computes what it computes cold.

Each comparison runs one request at a time, so every step has the same shapes cold and cached
and the reference backend's CPU arithmetic is repeatable: the claim is checked bitwise here too,
with a negative control (snapshots at page boundaries inside a chunk) that must break it."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config

from bi_core import EngineConfig, SamplingParams, build_engine
from bi_core.errors import ConfigError

GEN = torch.Generator().manual_seed(5)
SHARED = torch.randint(1, 250, (100,), generator=GEN).tolist()
A = SHARED + torch.randint(1, 250, (30,), generator=GEN).tolist()
B = SHARED + torch.randint(1, 250, (25,), generator=GEN).tolist()
PARAMS = SamplingParams(max_new_tokens=8, temperature=1.0, seed=2, ignore_eos=True, logprobs=2)


def engine(chunk: int = 32, **overrides):
    cfg = tiny_config(model={"random": {"preset": "tiny-moe", "seed": 0}},
                      scheduler={"max_num_batched_tokens": 64, "prefill_chunk_size": chunk}, **overrides)
    return build_engine(EngineConfig.from_dict(cfg))


def run(eng, prompt, params=PARAMS):
    return eng.generate([prompt], params)[0]


def same(a, b) -> bool:
    return a.token_ids == b.token_ids and a.token_logprobs == b.token_logprobs and a.logprobs == b.logprobs


def test_cached_prefix_is_bitwise_the_cold_prefill():
    cold = run(engine(cache={"block_size": 16, "num_blocks": 256, "prefix_caching": False}), B)
    eng = engine()
    first = run(eng, A)
    assert first.num_cached_tokens == 0
    got = run(eng, B)
    assert got.num_cached_tokens == 96  # chunk ends 32, 64, 96 lie in the shared 100 tokens
    assert same(got, cold)
    again = run(eng, B)  # B's own chunks are cached now: its 125-token prompt hits at 96 still (128 > 124)
    assert again.num_cached_tokens == 96 and same(again, cold)
    stats = eng.cache.prefix.stats()
    assert stats["hits"] == 2 and stats["hit_tokens"] == 192 and stats["queries"] == 3
    assert eng.scheduler.num_pages_used == 0 and stats["cached_pages"] > 0


def test_negative_control_snapshot_inside_a_chunk_breaks_it():
    prompt_a, prompt_b = SHARED[:48], SHARED[:48] + B[100:122]
    cold = run(engine(cache={"block_size": 16, "num_blocks": 256, "prefix_caching": False}), prompt_b)
    eng = engine()
    run(eng, prompt_a)  # chunks [0, 32) and [32, 48)
    ok = run(eng, prompt_b)
    assert ok.num_cached_tokens == 32 and same(ok, cold)  # the grid: the partial chunk was not cached
    bad = engine()
    bad.cache.prefix.grid = 16  # snapshot after any page-aligned chunked step: [32, 48) gets one
    run(bad, prompt_a)
    wrong = run(bad, prompt_b)
    assert wrong.num_cached_tokens == 48  # runs [48, 70) where a cold prefill ran [32, 64) and [64, 70)
    assert not same(wrong, cold)
    torch.testing.assert_close(torch.tensor(wrong.token_logprobs[:1]), torch.tensor(cold.token_logprobs[:1]),
                               atol=1e-4, rtol=0)  # close, but not the same bits


def test_eviction_under_memory_pressure_and_weight_updates():
    eng = engine(cache={"block_size": 16, "num_blocks": 40})
    cold = engine(cache={"block_size": 16, "num_blocks": 256, "prefix_caching": False})
    prompts = [torch.randint(1, 250, (100,), generator=GEN).tolist() for _ in range(6)]
    outs = eng.generate(prompts + [B, A], PARAMS)
    assert eng.cache.prefix.stats()["evicted_pages"] > 0  # 8 x 7 pages wanted over a 40-page cache
    for got, want in zip(outs, cold.generate(prompts + [B, A], PARAMS)):
        assert got.token_ids == want.token_ids
    assert eng.scheduler.num_pages_used == 0
    assert run(eng, A).num_cached_tokens == 128  # A ran last: all four of its full chunks are cached
    eng.update_weights({"model.norm.weight": torch.ones(eng.args.hidden_size)})
    assert eng.cache.prefix.stats()["cached_pages"] == 0 and eng.cache.blocks.num_free == 40
    assert run(eng, A).num_cached_tokens == 0


def test_scoring_samples_and_prompt_logprobs_use_the_cache_within_their_limits():
    eng = engine()
    cold = engine(cache={"block_size": 16, "num_blocks": 256, "prefix_caching": False})
    run(eng, A)
    sc = eng.score([SHARED[:70]], [B[70:]])[0]  # rows from position 69 on: a hit at 64 at most
    assert sc.token_logprobs == cold.score([SHARED[:70]], [B[70:]])[0].token_logprobs
    n = SamplingParams(max_new_tokens=6, temperature=1.0, seed=4, n=3, ignore_eos=True)
    got, want = run(eng, B, n), run(cold, B, n)
    assert got.num_cached_tokens == 96 and all(same(x, y) for x, y in zip(got.outputs, want.outputs))
    pl = run(eng, A, SamplingParams(max_new_tokens=2, prompt_logprobs=0))
    assert pl.num_cached_tokens == 0 and len(pl.prompt_logprobs) == len(A)  # every prompt row is wanted


def test_config():
    with pytest.raises(ConfigError, match="cache.prefix_caching: not with strategy mtp"):
        engine(strategy={"name": "mtp"}, cache={"block_size": 16, "num_blocks": 256, "prefix_caching": True})
    assert engine(strategy={"name": "mtp"}).cache.prefix is None  # auto: off where it cannot be exact
    with pytest.raises(ConfigError, match="multiple of cache.block_size"):
        engine(40, cache={"block_size": 16, "num_blocks": 256,
                                                            "prefix_caching": True})
    with pytest.raises(ConfigError, match="cache.prefix_caching"):
        engine(cache={"prefix_caching": "yes"})
