"""``SamplingParams.logprobs_mode``: "temperature" reports the distribution sampled at the request's
temperature, log_softmax(logits / T), top-N too; "raw" (the default) the model's. The tokens drawn
do not change, and a raw request beside temperature ones keeps its bits."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config

from bi_core import EngineConfig, RequestError, SamplingParams, build_engine

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def eng():
    return build_engine(EngineConfig.from_dict(tiny_config(model={"random": {"preset": "tiny-moe", "seed": 2}})))


def test_temperature_logprobs_of_the_same_tokens(eng):
    raw = SamplingParams(max_new_tokens=6, temperature=0.6, seed=3, ignore_eos=True, logprobs=3)
    hot = SamplingParams(max_new_tokens=6, temperature=0.6, seed=3, ignore_eos=True, logprobs=3,
                         logprobs_mode="temperature")
    a, b, c = eng.generate([PROMPT, PROMPT, PROMPT], [raw, hot, raw])
    assert a.token_ids == b.token_ids == c.token_ids
    # the reference backend's rows are not batch-invariant (its CPU GEMMs split rows over threads):
    # the raw rows are compared with the same rows of an all-raw batch
    plain = eng.generate([PROMPT, PROMPT, PROMPT], [raw, raw, raw])
    assert [(x.token_logprobs, x.logprobs) for x in (a, c)] == [(x.token_logprobs, x.logprobs) for x in plain[::2]]
    # log_softmax(logits / 0.6) is sharper than the raw distribution: the top token's logprob is higher
    for r, h in zip(a.logprobs, b.logprobs):
        top = max(r, key=r.get)
        assert max(h, key=h.get) == top and h[top] > r[top]
    assert b.token_logprobs != a.token_logprobs


def test_temperature_mode_is_raw_at_1_and_greedy(eng):
    for t in (0.0, 1.0):
        kw = dict(max_new_tokens=4, temperature=t, seed=5, ignore_eos=True)
        raw = eng.generate([PROMPT, PROMPT], [SamplingParams(**kw)] * 2)[0]  # row 0 of the same batch shape
        hot = eng.generate([PROMPT, PROMPT], [SamplingParams(**kw, logprobs_mode="temperature"), SamplingParams(**kw)])[0]
        assert raw.token_logprobs == hot.token_logprobs


def test_logprobs_mode_is_checked():
    with pytest.raises(RequestError, match="logprobs_mode must be one of raw, temperature"):
        SamplingParams(logprobs_mode="processed_logprobs")


def test_temperature_logprobs_match_the_formula(eng):
    out = eng.generate([PROMPT], SamplingParams(max_new_tokens=3, temperature=1.5, seed=8, ignore_eos=True,
                                                logprobs_mode="temperature"))[0]
    seen = []
    eng.runner.on_logits = lambda seqs, logits: seen.append(logits[0].float().clone())
    try:
        eng.generate([PROMPT], SamplingParams(max_new_tokens=3, temperature=1.5, seed=8, ignore_eos=True,
                                              logprobs_mode="temperature"))
    finally:
        eng.runner.on_logits = None
    want = [torch.log_softmax(lg / 1.5, dim=-1)[t].item() for lg, t in zip(seen, out.token_ids)]
    torch.testing.assert_close(torch.tensor(out.token_logprobs), torch.tensor(want), atol=1e-6, rtol=0)
