"""Sampling: (seed, position)-keyed randomness, filters, logprobs."""

from __future__ import annotations

import torch

from bi_core.backends.reference.sampling import ReferenceSamplerImpl, filter_logits
from bi_core.ops.sampling import SamplingBatch, mix_seed


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
