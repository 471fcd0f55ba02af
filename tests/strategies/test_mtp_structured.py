"""MTP under a grammar emits the AR tokens, whatever the drafts (forced through ``draft_hook``:
all accepted, none, accepted up to a random point): each verify row is masked with the grammar
state after the drafts before it (on a copy of the sequence's state), and a row after a draft the
grammar refuses is never kept. Negative control: verify rows masked with the state before the
step's drafts no longer give AR's tokens."""

from __future__ import annotations

import json
import random

import pytest
import torch
from test_mtp import config, hook_for, prompts

from bi_core import SamplingParams, build_engine
from bi_core.structured import json_schema, regex

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tag": {"enum": ["ab", "cd"]}, "ok": {"type": "boolean"}},
          "required": ["n", "tag", "ok"]}
PARAMS = {
    "greedy_json": SamplingParams(max_new_tokens=48, logprobs=2, structured=json_schema(SCHEMA, any_whitespace=False)),
    "sampled_json": SamplingParams(max_new_tokens=48, temperature=0.9, seed=3,
                                   structured=json_schema(SCHEMA, any_whitespace=False)),
    "sampled_regex": SamplingParams(max_new_tokens=30, temperature=1.0, seed=8, structured=regex(r"([a-d]{2}-)+\d")),
}


def run_mtp(ps, params, truth, kind, *, drafts_before=True):
    eng = build_engine(config("tiny-moe", "mtp"))
    eng.strategy.draft_hook = hook_for(kind, truth, random.Random(5))
    if not drafts_before:
        sample = eng.runner.sample
        eng.runner.sample = lambda seqs, positions, logits, samples=None, before=None: sample(
            seqs, positions, logits, samples)
    return eng.generate(ps, params)


@pytest.mark.parametrize("mode", list(PARAMS))
@pytest.mark.parametrize("kind", ["all", "partial", "none"])
def test_mtp_equals_ar_under_a_grammar(mode, kind):
    ps, params = prompts(), PARAMS[mode]
    ar = build_engine(config("tiny-moe", "ar")).generate(ps, params)
    out = run_mtp(ps, params, {i: o.token_ids for i, o in enumerate(ar)}, kind)
    for a, m in zip(ar, out):
        assert m.token_ids == a.token_ids and m.finish_reason == a.finish_reason
        torch.testing.assert_close(torch.tensor(m.token_logprobs), torch.tensor(a.token_logprobs), atol=1e-5, rtol=1e-5)
        if kind == "all":
            assert m.num_accepted_draft_tokens == m.num_draft_tokens > 0
    if mode.endswith("json"):
        assert sum(a.finish_reason == "stop" for a in ar) >= 2
        for a in ar:
            if a.finish_reason == "stop":
                assert set(json.loads(a.text)) == {"n", "tag", "ok"}


def test_negative_control_verify_rows_masked_without_the_drafts_before_them():
    ps, params = prompts(), PARAMS["sampled_json"]
    ar = build_engine(config("tiny-moe", "ar")).generate(ps, params)
    out = run_mtp(ps, params, {i: o.token_ids for i, o in enumerate(ar)}, "all", drafts_before=False)
    assert any(m.token_ids != a.token_ids for a, m in zip(ar, out))
