"""MTP with penalties, min_p and min_tokens emits the AR tokens: a verify row's penalties count
the drafts before it in the same step (its sample is kept only where they were accepted, so they
are AR's tokens there), min_tokens' mask follows the row's position. Negative control: verify rows
that leave the drafts before them out of their penalties no longer give AR's tokens."""

from __future__ import annotations

import random

import pytest
import torch
from test_mtp import config, hook_for, prompts

from bi_core import SamplingParams, build_engine

PARAMS = {
    # repeats encouraged (negative penalties), so a verify step's drafts hold the tokens penalized
    "greedy": SamplingParams(max_new_tokens=20, ignore_eos=True, frequency_penalty=-2.0, repetition_penalty=1.3,
                             logprobs=2),
    "sampled": SamplingParams(max_new_tokens=20, ignore_eos=True, presence_penalty=-2.0, temperature=0.8, seed=3,
                              min_p=0.1),
    # stops at 3 and 8 tokens without min_tokens; here at 14 and 13 (and one at 15 either way)
    "min_tokens": SamplingParams(max_new_tokens=20, min_tokens=12, stop_token_ids=(233, 208, 184), temperature=0.8,
                                 seed=3),
}


def run_mtp(ps, params, truth, kind, *, count_drafts=True):
    eng = build_engine(config("tiny-moe", "mtp"))
    eng.strategy.draft_hook = hook_for(kind, truth, random.Random(5))
    if not count_drafts:
        sample = eng.runner.sample
        eng.runner.sample = lambda seqs, positions, logits, samples=None, before=None: sample(
            seqs, positions, logits, samples)
    return eng.generate(ps, params)


@pytest.mark.parametrize("mode", list(PARAMS))
@pytest.mark.parametrize("kind", ["all", "partial", "none"])
def test_mtp_equals_ar_with_penalties_min_p_and_min_tokens(mode, kind):
    ps, params = prompts(), PARAMS[mode]
    ar = build_engine(config("tiny-moe", "ar")).generate(ps, params)
    out = run_mtp(ps, params, {i: o.token_ids for i, o in enumerate(ar)}, kind)
    for a, m in zip(ar, out):
        assert m.token_ids == a.token_ids and m.finish_reason == a.finish_reason
        torch.testing.assert_close(torch.tensor(m.token_logprobs), torch.tensor(a.token_logprobs), atol=1e-5, rtol=1e-5)
        if kind == "all":
            assert m.num_accepted_draft_tokens == m.num_draft_tokens > 0


def test_negative_control_verify_rows_without_the_drafts_before_them():
    ps, params = prompts(), PARAMS["greedy"]
    ar = build_engine(config("tiny-moe", "ar")).generate(ps, params)
    out = run_mtp(ps, params, {i: o.token_ids for i, o in enumerate(ar)}, "all", count_drafts=False)
    assert any(m.token_ids != a.token_ids for a, m in zip(ar, out))
