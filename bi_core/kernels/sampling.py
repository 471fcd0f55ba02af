"""Per-row sampler: greedy argmax, or Gumbel-max over logits / T with noise from Philox keyed by
the row's own (seed, position) seed; plus the row's log-sum-exp for logprobs. One row per
program, the vocabulary walked in fixed chunks."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sample_kernel(L, SEEDS, TEMPS, TOKENS, LSE, V, stride_l, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    seed = tl.load(SEEDS + row)
    temp = tl.load(TEMPS + row)
    inv_t = 1.0 / tl.where(temp > 0.0, temp, 1.0)
    m = float("-inf")
    s = 0.0
    best = float("-inf")
    best_idx = 0
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        mask = cols < V
        x = tl.load(L + row * stride_l + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.where(mask, tl.exp(x - m_new), 0.0), axis=0)
        m = m_new
        if temp > 0.0:
            u = tl.rand(seed, cols)
            u = tl.minimum(tl.maximum(u, 1e-20), 1.0 - 1e-7)
            score = x * inv_t - tl.log(-tl.log(u))
        else:
            score = x
        score = tl.where(mask, score, float("-inf"))
        cand = tl.max(score, axis=0)
        cand_idx = tl.min(tl.where(score == cand, cols, V), axis=0)
        take = cand > best
        best_idx = tl.where(take, cand_idx, best_idx)
        best = tl.where(take, cand, best)
    tl.store(TOKENS + row, best_idx.to(tl.int64))
    tl.store(LSE + row, m + tl.log(s))


def sample(logits: torch.Tensor, seeds: torch.Tensor, temperatures: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (token ids ``[B]``, log-sum-exp of the raw logits ``[B]``); ``seeds`` are the
    per-row mixed (request seed, position) seeds (int64, < 2**63)."""
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        _sample_kernel[(rows,)](logits, seeds, temperatures, tokens, lse, vocab, logits.stride(0),
                                BLOCK_V=min(4096, triton.next_power_of_2(vocab)), num_warps=8)
    return tokens, lse
