"""engine.score and prompt_logprobs: the logprobs of given tokens, in decode arithmetic (exact) or
one chunked prefill (fast). On the reference backend values match to float tolerance (its CPU
GEMMs are not row-invariant); the bitwise claims are checked on the GPU (tests/gpu/test_rl_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config
from hf_fixtures import make_hf_model, save_checkpoint

from bi_core import EngineConfig, SamplingParams, build_engine

PROMPTS = [[(5 * i + j) % 250 + 1 for j in range(n)] for i, n in enumerate((9, 40, 3))]


def engine(**overrides):
    cfg = tiny_config(model={"random": {"preset": "tiny-moe", "seed": 0}},
                      scheduler={"max_num_batched_tokens": 64, "prefill_chunk_size": 16}, **overrides)
    return build_engine(EngineConfig.from_dict(cfg))


def record_steps(eng) -> list[list[tuple[int, bool]]]:
    """(query length, recurrent) of each sequence in every step the engine runs from now on."""
    steps = []
    execute = eng.runner.execute

    def spy(fwd, **kw):
        steps.append([(len(r.tokens), r.recurrent) for r in fwd.rows])
        return execute(fwd, **kw)

    eng.runner.execute = spy
    return steps


@pytest.mark.parametrize("exact", [True, False])
def test_scored_logprobs_match_the_sampled_ones(exact):
    eng = engine()
    gen = eng.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=0.9, seed=4, ignore_eos=True))
    steps = record_steps(eng)
    scores = eng.score(PROMPTS, [g.token_ids for g in gen], exact=exact)
    for g, sc, prompt in zip(gen, scores, PROMPTS):
        assert sc.error is None and sc.exact is exact
        assert sc.prompt_token_ids == prompt and sc.token_ids == g.token_ids
        torch.testing.assert_close(torch.tensor(sc.token_logprobs), torch.tensor(g.token_logprobs), atol=2e-5, rtol=0)
    flat = [x for step in steps for x in step]
    if exact:  # the 40-token prompt runs in 16-token chunks (16, 16, 8), then 11 continuation tokens recurrent
        assert (8, False) in flat and (11, True) in flat
    else:  # one chunked prefill over prompt + continuation minus its last token: 51 = 16 + 16 + 16 + 3
        assert all(not r for _, r in flat) and (3, False) in flat
    assert eng.scheduler.num_pages_used == 0 and not eng.requests


def test_exact_continuation_steps_stay_within_the_decode_query_length():
    eng = engine()
    assert eng.scheduler.exact_step_tokens is None  # the reference attention has one path for any length
    eng.scheduler.exact_step_tokens = 4  # as a backend whose longer recurrent queries take a prefill path
    steps = record_steps(eng)
    eng.score([PROMPTS[1]], [list(range(1, 12))])
    assert [x for step in steps for x in step] == [(16, False), (16, False), (8, False), (4, True), (4, True),
                                                   (2, True)]


def test_scoring_matches_transformers_and_prompt_logprobs(tmp_path):
    hf = make_hf_model("moe")
    path = save_checkpoint(hf, tmp_path / "ckpt")
    cfg = {"model": {"path": str(path), "dtype": "float32", "device": "cpu"}, "backend": "reference",
           "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 64, "prefill_chunk_size": 32},
           "cache": {"block_size": 16, "num_blocks": 64}}
    eng = build_engine(EngineConfig.from_dict(cfg))
    ids = torch.randint(0, 300, (70,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        expected = torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    want = expected[torch.arange(69), torch.tensor(ids[1:])]
    for exact in (True, False):
        sc = eng.score([ids[:30]], [ids[30:]], exact=exact, logprobs=2)[0]
        torch.testing.assert_close(torch.tensor(sc.token_logprobs), want[29:], atol=1e-4, rtol=0)
        assert all(len(d) in (2, 3) and d[t] == lp for d, t, lp in zip(sc.logprobs, sc.token_ids, sc.token_logprobs))
    out = eng.generate([ids], SamplingParams(max_new_tokens=2, prompt_logprobs=1))[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 70
    got = torch.tensor([d[t] for d, t in zip(out.prompt_logprobs[1:], ids[1:])])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert all(max(d.values()) == pytest.approx(float(expected[j].max()), abs=1e-4)
               for j, d in enumerate(out.prompt_logprobs[1:]))


def test_scoring_beside_generation_and_with_mtp():
    alone = engine().score(PROMPTS, [[3, 1, 4, 1, 5]] * 3)
    for strategy in ({"name": "ar"}, {"name": "mtp", "num_speculative_tokens": 2}):
        eng = engine(strategy=strategy)
        gen_alone = eng.generate(PROMPTS, SamplingParams(max_new_tokens=8, seed=1, temperature=0.5, ignore_eos=True))
        gens = [eng.add_request(p, SamplingParams(max_new_tokens=8, seed=1, temperature=0.5, ignore_eos=True))
                for p in PROMPTS]
        scores = [eng.add_score_request(p, [3, 1, 4, 1, 5]) for p in PROMPTS]
        while eng.scheduler.has_work():
            eng.step()
        assert [g.output_ids for g in gens] == [g.token_ids for g in gen_alone]
        for s, a in zip(scores, alone):
            torch.testing.assert_close(torch.tensor(s.scored_logprobs), torch.tensor(a.token_logprobs), atol=2e-5,
                                       rtol=0)


def test_bad_score_requests():
    eng = engine()
    out = eng.score([[1, 2], [1, 2], [1, 2]], [[], [999999], [1] * 600])
    assert "continuation is empty" in out[0].error
    assert "outside the vocabulary" in out[1].error
    assert "max_model_len" in out[2].error
    with pytest.raises(Exception, match="2 prompts but 1 continuations"):
        eng.score([[1], [2]], [[3]])


def test_a_lone_prompt_and_continuation_are_one_pair():
    """``score("ab", "cd")`` scores one pair (a str is one prompt, as in ``generate``), not the
    pairs of its characters; a flat list of ids likewise."""
    eng = engine()
    one = eng.score("ab", "cd")
    assert len(one) == 1 and one[0].error is None and len(one[0].token_logprobs) == 2
    assert one[0].token_logprobs == eng.score(["ab"], ["cd"])[0].token_logprobs
    ids = eng.score([5, 6, 7], [8, 9])
    assert len(ids) == 1 and ids[0].token_ids == [8, 9]
