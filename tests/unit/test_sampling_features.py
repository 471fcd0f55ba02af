"""vLLM's min_tokens, min_p and penalties through the engine (reference backend): what ends a
request and when, what the penalties change, and that the logprobs reported stay raw."""

from __future__ import annotations

import math

import attrs
import pytest
import torch
from helpers import tiny_config

from bi_core import EngineConfig, SamplingParams, build_engine
from bi_core.runtime.sampling_batch import sampling_batch
from bi_core.runtime.sequence import Sequence

PROMPT = [1, 2, 3, 4]


@pytest.fixture(scope="module")
def eng():
    return build_engine(EngineConfig.from_dict(tiny_config(model={"random": {"preset": "tiny-moe", "seed": 1}})))


def test_min_tokens_holds_back_stop_tokens_and_eos(eng):
    free = eng.generate([PROMPT], SamplingParams(max_new_tokens=24, ignore_eos=True))[0].token_ids
    stop = free[2]
    early = eng.generate([PROMPT], SamplingParams(max_new_tokens=24, stop_token_ids=stop))[0]
    assert early.token_ids == free[:3] and early.finish_reason == "stop"
    held = eng.generate([PROMPT], SamplingParams(max_new_tokens=24, stop_token_ids=stop, min_tokens=6))[0]
    assert stop not in held.token_ids[:6] and held.token_ids[:2] == free[:2]
    assert held.finish_reason == "length" or (held.token_ids[-1] == stop and len(held.token_ids) > 6)


def test_min_tokens_bans_stop_ids_and_eos_by_position():
    """The rows of one sequence (an MTP verify's 1+N) are banned by their own positions; EOS too
    under ignore_eos, as vLLM's MinTokensLogitsProcessor does."""
    params = SamplingParams(max_new_tokens=8, min_tokens=3, stop_token_ids=(7, 300), ignore_eos=True)
    seq = Sequence(request_id=0, prompt_ids=[1, 2], params=params, seed=0, max_total_len=10, output_ids=[5])
    batch = sampling_batch([seq] * 3, [3, 4, 5], 0, eos_ids=(9,), vocab_size=260, before=[[], [6], [6, 7]])
    assert [a.banned if a else None for a in batch.adjust] == [(7, 9), (7, 9), None]  # 300: not in the vocabulary
    assert batch.is_plain(2) and not batch.is_plain(0)
    penalized = sampling_batch([attrs.evolve(seq, params=attrs.evolve(params, min_tokens=0, frequency_penalty=1.0))],
                               [5], 0, eos_ids=(9,), vocab_size=260, before=[[6, 7]])
    assert penalized.adjust[0].output_ids == [5, 6, 7] and penalized.adjust[0].seen_ids == []


def test_min_tokens_ignores_stop_strings_in_the_text_of_its_first_tokens(eng):
    """vLLM's rule: a stop string must end in text that a token after the first min_tokens completes."""
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    full = eng.generate([PROMPT], params)[0]
    text = eng.tokenizer.decode(full.token_ids)
    stop = next(c for c in text[1:] if c.isascii() and c.isprintable())
    first = text.index(stop)
    cut = eng.generate([PROMPT], attrs.evolve(params, stop=stop))[0]
    assert cut.text == text[:first] and cut.finish_reason == "stop"
    k = len(eng.tokenizer.decode(full.token_ids[:first + 1]).encode())  # enough tokens to cover the first match
    held = eng.generate([PROMPT], attrs.evolve(params, stop=stop, min_tokens=k))[0]
    protected = len(eng.tokenizer.decode(full.token_ids[:k]))
    later = text.find(stop, protected)
    assert held.token_ids == full.token_ids[:len(held.token_ids)]  # stop strings ban no token
    assert held.text == (text[:later] if later >= 0 else text)
    assert held.finish_reason == ("stop" if later >= 0 else "length")


def test_penalties_change_greedy_tokens_and_keep_raw_logprobs(eng):
    """Greedy tiny-moe (seed 1) repeats token 186 at position 27; each penalty moves it off, and
    the logprobs of the tokens it chose are those the model gives them (scored without penalties)."""
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    free = eng.generate([PROMPT], params)[0]
    assert free.token_ids[27] == free.token_ids[0]
    for penalty in ({"repetition_penalty": 1.5}, {"frequency_penalty": 1.0}, {"presence_penalty": 1.0}):
        out = eng.generate([PROMPT], attrs.evolve(params, **penalty))[0]
        assert out.token_ids[:27] == free.token_ids[:27] and out.token_ids[27] != free.token_ids[27], penalty
        assert out.token_logprobs[:27] == free.token_logprobs[:27]
        scored = eng.score([PROMPT], [out.token_ids])[0].token_logprobs
        torch.testing.assert_close(torch.tensor(out.token_logprobs), torch.tensor(scored), atol=1e-5, rtol=1e-5)
    # negative values encourage repeats: the same token over and over
    loop = eng.generate([PROMPT], attrs.evolve(params, presence_penalty=-2.0, frequency_penalty=-2.0))[0]
    assert len(set(loop.token_ids[5:])) == 1


def test_min_p_narrows_sampling(eng):
    """min_p 0.5 at temperature 1: every token drawn has at least half the top token's probability."""
    params = SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=1.0, seed=7, logprobs=1)

    def margins(out) -> list[float]:  # log p(token) - log p(top) - log(min_p): >= 0 where min_p keeps it
        return [lp - max(d.values()) - math.log(0.5) for lp, d in zip(out.token_logprobs, out.logprobs)]
    wide = eng.generate([PROMPT], params)[0]
    narrow = eng.generate([PROMPT], attrs.evolve(params, min_p=0.5))[0]
    assert min(margins(wide)) < 0 and min(margins(narrow)) > -1e-5
