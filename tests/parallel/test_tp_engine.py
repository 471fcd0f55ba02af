"""Tensor parallelism on the CPU: two engine processes over gloo on the reference backend must
give what one process gives (float tolerance), from a transformers checkpoint (sharded on load:
vocabulary-parallel embedding and head, heads, expert widths with zero padding) and from a random
preset, through the lock-step calls (requests arriving between steps, n samples, aborts, MTP)."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config
from hf_fixtures import make_hf_model, save_checkpoint

from bi_core import BiEngineError, ConfigError, EngineConfig, SamplingParams, build_engine
from bi_core.parallel.shard import split

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], list(range(10, 90))]


def _config(tp: int, **overrides) -> EngineConfig:
    return EngineConfig.from_dict(tiny_config(parallel={"tensor_parallel_size": tp}, **overrides))


def _same(a, b) -> None:
    assert a.token_ids == b.token_ids
    torch.testing.assert_close(torch.tensor(a.token_logprobs), torch.tensor(b.token_logprobs), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind,tie,strategy,experts", [("moe", False, "mtp", "fused"), ("dense", True, "ar", "fused"),
                                                        ("moe", False, "ar", "per_expert")])
def test_tp2_checkpoint_matches_tp1(tmp_path, kind, tie, strategy, experts):
    path = save_checkpoint(make_hf_model(kind, tie=tie), tmp_path / "ckpt", experts=experts, with_mtp=True)
    model = {"path": str(path), "random": None, "max_model_len": 256}
    extra = {"strategy": {"name": strategy, "num_speculative_tokens": 2}} if strategy == "mtp" else {}
    params = SamplingParams(max_new_tokens=12, temperature=0.8, seed=3)
    one = build_engine(_config(1, model=model, **extra)).generate(PROMPTS, params)
    eng = build_engine(_config(2, model=model, **extra))
    try:
        assert eng.model.embed_tokens.shape[0] == 150  # this rank's half of the vocabulary
        two = eng.generate(PROMPTS, params)
    finally:
        eng.close()
    for a, b in zip(one, two):
        _same(a, b)


def test_tp4_replicates_kv_heads_and_matches_tp1(tmp_path):
    """Four ranks over two KV heads: each KV head on two ranks, each rank a quarter of the query
    heads (all in that KV head's group), GDN heads and expert widths in quarters."""
    hf = make_hf_model("moe", num_attention_heads=8, linear_num_key_heads=4, linear_num_value_heads=8)
    path = save_checkpoint(hf, tmp_path / "ckpt", experts="fused")
    model = {"path": str(path), "random": None, "max_model_len": 256}
    params = SamplingParams(max_new_tokens=8)
    one = build_engine(_config(1, model=model)).generate(PROMPTS, params)
    eng = build_engine(_config(4, model=model))
    try:
        assert eng.cache.main.k[0].shape[2] == 1  # one (replicated) KV head per rank
        two = eng.generate(PROMPTS, params)
    finally:
        eng.close()
    for a, b in zip(one, two):
        _same(a, b)


def _drive(eng) -> dict[int, list[int]]:
    """Requests arriving between steps, n samples, one aborted mid-run, a scored pair."""
    s0 = eng.add_request(PROMPTS[0], SamplingParams(max_new_tokens=10, n=2, temperature=1.0, seed=5))
    eng.step()
    s1 = eng.add_request(PROMPTS[2], SamplingParams(max_new_tokens=10))
    victim = eng.add_request(PROMPTS[1], SamplingParams(max_new_tokens=30))
    eng.step()
    eng.step()
    eng.abort(victim.request_id)
    score = eng.add_score_request(PROMPTS[1], [4, 5, 6])
    while eng.scheduler.has_work():
        eng.step()
    assert victim.finish_reason == "abort" and len(score.scored_logprobs) == 3
    return {s.request_id: (s.output_ids, s.token_logprobs) for s in s0.group + [s1]} | {"score": score.scored_logprobs}


def test_tp2_lockstep_calls_match_tp1():
    one = _drive(build_engine(_config(1, model={"random": {"preset": "tiny-moe", "seed": 0}})))
    eng = build_engine(_config(2, model={"random": {"preset": "tiny-moe", "seed": 0}}))
    try:
        two = _drive(eng)
    finally:
        eng.close()
    assert one.keys() == two.keys()
    for k in one:
        if k == "score":
            torch.testing.assert_close(torch.tensor(one[k]), torch.tensor(two[k]), atol=1e-4, rtol=1e-4)
        else:
            assert one[k][0] == two[k][0]
            torch.testing.assert_close(torch.tensor(one[k][1]), torch.tensor(two[k][1]), atol=1e-4, rtol=1e-4)


def test_tp_errors_name_the_problem():
    with pytest.raises(ConfigError, match="parallel.tensor_parallel_size.*linear_num_key_heads=2"):
        build_engine(_config(4))


@pytest.mark.parametrize("how", ["tensors", "directory"])
def test_tp2_update_weights_equals_loading_the_new_checkpoint(tmp_path, how):
    """Rank 0 checks the update, then every rank copies its shard: tensors broadcast from rank 0,
    or each rank reading the directory. A bad update is refused before anything moves."""
    old = save_checkpoint(make_hf_model("moe", seed=0), tmp_path / "old", experts="fused")
    new_hf = make_hf_model("moe", seed=1)
    new = save_checkpoint(new_hf, tmp_path / "new", experts="fused")
    params = SamplingParams(max_new_tokens=8)
    model = {"path": str(new), "random": None, "max_model_len": 256}
    want = build_engine(_config(1, model=model)).generate(PROMPTS, params)
    eng = build_engine(_config(2, model={**model, "path": str(old)}))
    try:
        before = eng.generate(PROMPTS, params)
        with pytest.raises(BiEngineError, match="shape"):
            eng.update_weights({"model.norm.weight": torch.zeros(3)})
        weights = str(new) if how == "directory" else new_hf.state_dict()
        assert eng.update_weights(weights) > 0
        got = eng.generate(PROMPTS, params)
    finally:
        eng.close()
    assert [o.token_ids for o in before] != [o.token_ids for o in want]  # the update has something to change
    for a, b in zip(want, got):
        _same(a, b)


def test_shard_ranges_split_each_part_and_replicate_short_ones():
    qkv = split(0, (8, 4), (4, 2), (4, 2))  # 4 query heads, 2 KV heads of size 2
    assert qkv.ranges(1, 2) == [(4, 8), (10, 12), (14, 16)]
    assert qkv.ranges(3, 4) == [(6, 8), (10, 12), (14, 16)]  # KV heads replicated: ranks 2, 3 hold head 1
    assert qkv.local_size(4) == 2 + 2 + 2
    full = torch.arange(16)
    assert qkv.take(full, 0, 2).tolist() == [0, 1, 2, 3, 8, 9, 12, 13]


def test_explain_shows_the_collectives_the_policy_chose():
    from pathlib import Path

    from bi_core.runtime.build import explain

    text = explain(EngineConfig.from_yaml(Path(__file__).parents[2] / "configs" / "h200x2_invariant_tp2.yaml"))
    assert "all_reduce    -> cuda_hopper_invariant" in text and "summed in rank order" in text
    assert "all_gather    -> cuda_hopper_invariant" in text
    assert "all_reduce" not in explain(_config(1))


def test_a_rank_that_died_is_reported_not_waited_for():
    eng = build_engine(_config(2))
    try:
        worker = eng._driver.procs[0]
        worker.kill()
        worker.join(10)
        with pytest.raises(BiEngineError, match=r"tensor-parallel rank\(s\) 1 \(exit code -9\) stopped"):
            eng.generate([PROMPTS[0]], SamplingParams(max_new_tokens=2))
    finally:
        eng.close()
