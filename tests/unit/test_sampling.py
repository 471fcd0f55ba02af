"""Sampling: (seed, position)-keyed randomness, filters, logprobs."""

from __future__ import annotations

import torch

from bi_core.backends.reference.sampling import ReferenceSamplerImpl, adjust_logits, filter_logits
from bi_core.ops.sampling import LogitsAdjust, SamplingBatch, mix_seed


def batch(n, temp=1.0, top_k=0, top_p=1.0, seeds=None, positions=None, num_logprobs=0):
    seeds = seeds if seeds is not None else [0] * n
    positions = positions if positions is not None else [0] * n
    return SamplingBatch(temperatures=[temp] * n, top_ks=[top_k] * n, top_ps=[top_p] * n,
                         keys=[mix_seed(s, p) for s, p in zip(seeds, positions)], num_logprobs=num_logprobs)


def test_mix_seed_spreads_and_is_63_bit():
    values = {mix_seed(s, p) for s in range(20) for p in range(20)}
    assert len(values) == 400 and max(values) < 2**63


def test_draw_depends_only_on_seed_and_position():
    torch.manual_seed(0)
    logits = torch.randn(5, 1000)
    s = ReferenceSamplerImpl()
    full = s.forward(logits, batch(5, seeds=[1, 2, 3, 4, 5], positions=[9, 9, 9, 9, 9])).token_ids
    alone = [s.forward(logits[i:i + 1], batch(1, seeds=[i + 1], positions=[9])).token_ids[0] for i in range(5)]
    assert full.tolist() == [int(t) for t in alone]
    moved = s.forward(logits, batch(5, seeds=[1, 2, 3, 4, 5], positions=[10] * 5)).token_ids
    assert moved.tolist() != full.tolist()  # a new position draws new noise (5 rows, 1000 tokens)


def test_temperature_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))[None].repeat(3000, 1)
    out = ReferenceSamplerImpl().forward(logits, batch(3000, seeds=list(range(3000)))).token_ids
    freq = torch.bincount(out, minlength=3).float() / 3000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.04)


def test_top_k_and_top_p_filters():
    row = torch.tensor([1.0, 3.0, 2.0, 0.0])
    assert torch.isinf(filter_logits(row, 2, 1.0)).tolist() == [True, False, False, True]
    probs = torch.softmax(row, 0)  # 0.64, 0.24, 0.09, 0.03 for 3.0, 2.0, 1.0, 0.0
    kept = ~torch.isinf(filter_logits(row, 0, float(probs[1] + 0.01)))
    assert kept.tolist() == [False, True, True, False]
    greedy = ReferenceSamplerImpl().forward(row[None], batch(1, top_k=1, seeds=[3])).token_ids
    assert greedy.tolist() == [1]


def test_greedy_and_logprobs():
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    out = ReferenceSamplerImpl().forward(logits, batch(1, temp=0.0, num_logprobs=2))
    lp = torch.log_softmax(logits, -1)[0]
    assert out.token_ids.tolist() == [1]
    assert torch.allclose(out.logprobs, lp[1:2]) and out.top_ids.tolist() == [[1, 2]]


# ------------------------------------------------------------ penalties, min_p, min_tokens (vLLM's)

def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    row = torch.tensor([2.0, -1.0, 3.0, -4.0, 0.5])
    out = adjust_logits(row, LogitsAdjust(seen_ids=[0, 1, 1], repetition_penalty=2.0))
    assert out.tolist() == [1.0, -2.0, 3.0, -4.0, 0.5]  # only tokens 0 and 1 were seen


def test_frequency_and_presence_penalties_count_the_output_tokens():
    row = torch.zeros(4)
    out = adjust_logits(row, LogitsAdjust(output_ids=[1, 1, 1, 3], frequency_penalty=0.5, presence_penalty=0.25))
    assert out.tolist() == [0.0, -1.75, 0.0, -0.75]  # 3 x 0.5 + 0.25, 1 x 0.5 + 0.25


def test_banned_ids_are_minus_infinity():
    out = adjust_logits(torch.ones(4), LogitsAdjust(banned=(0, 2)))
    assert torch.isinf(out).tolist() == [True, False, True, False] and (out[[0, 2]] < 0).all()


def test_min_p_keeps_tokens_at_least_min_p_times_the_top_probability():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = ~torch.isinf(filter_logits(probs.log(), 0, 1.0, min_p=0.3))  # threshold 0.15
    assert kept.tolist() == [True, True, True, False]


def adjusted_batch(n, adjust, temp=0.0, min_p=0.0, num_logprobs=2):
    b = batch(n, temp=temp, seeds=list(range(n)), num_logprobs=num_logprobs)
    b.adjust, b.min_ps = adjust, [min_p] * n
    return b


def test_penalties_choose_the_token_and_logprobs_stay_raw():
    """vLLM's default logprobs_mode (raw_logprobs): the reported logprobs are the model's, before
    any penalty or mask; the token is the adjusted logits' choice (greedy rows too)."""
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]])
    raw = torch.log_softmax(logits, -1)[0]
    out = ReferenceSamplerImpl().forward(logits, adjusted_batch(1, [LogitsAdjust(banned=(1,))]))
    assert out.token_ids.tolist() == [2]  # the top token is banned (min_tokens)
    assert torch.equal(out.logprobs, raw[2:3]) and out.top_ids.tolist() == [[1, 2]]
    assert torch.equal(out.top_logprobs[0], raw[[1, 2]])
    out = ReferenceSamplerImpl().forward(logits, adjusted_batch(1, [LogitsAdjust(output_ids=[1], presence_penalty=2.0)]))
    assert out.token_ids.tolist() == [2] and torch.equal(out.logprobs, raw[2:3])


def test_min_p_filters_sampled_rows_only():
    logits = torch.tensor([[3.0, 5.0, 4.9, -9.0]]).repeat(400, 1)  # p = 0.07, 0.49, 0.44, 0
    greedy = ReferenceSamplerImpl().forward(logits, adjusted_batch(400, None, temp=0.0, min_p=0.99))
    assert set(greedy.token_ids.tolist()) == {1}
    drawn = ReferenceSamplerImpl().forward(logits, adjusted_batch(400, None, temp=1.0, min_p=0.5)).token_ids
    assert set(drawn.tolist()) == {1, 2}  # 0 and 3 are below half the top probability
    unfiltered = ReferenceSamplerImpl().forward(logits, adjusted_batch(400, None, temp=1.0)).token_ids
    assert 0 in unfiltered.tolist()  # about 26 of 400 draws
