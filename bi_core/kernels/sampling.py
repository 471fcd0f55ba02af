"""Per-row sampler: greedy argmax, or Gumbel-max over logits / T with noise from Philox keyed by
the row's own (seed, position) seed, over the tokens its grammar's bitmask allows (a structured
output; xgrammar's int32 layout, one mask row per logits row or none); plus the row's log-sum-exp
of the raw logits for logprobs. One row per program, the vocabulary walked in fixed chunks."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bi_core.kernels.common import pdl, pdl_start

CHUNK = 8192  # vocabulary slice per program; the split is fixed by the vocabulary size alone


@triton.jit
def _sample_partial_kernel(L, SEEDS, TEMPS, MASK, MASK_ROWS, PART_M, PART_S, PART_BEST, PART_IDX, V, stride_l,
                           stride_m, num_chunks, CHUNK: tl.constexpr, BLOCK_V: tl.constexpr, HAS_MASK: tl.constexpr,
                           PDL: tl.constexpr, pdl_early):
    pdl_start(PDL, pdl_early)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    seed = tl.load(SEEDS + row)
    temp = tl.load(TEMPS + row)
    inv_t = 1.0 / tl.where(temp > 0.0, temp, 1.0)
    if HAS_MASK:
        mask_row = tl.load(MASK_ROWS + row).to(tl.int64)  # -1: the row has no mask
    m = float("-inf")
    s = 0.0
    best = float("-inf")
    best_idx = 0
    for v0 in range(c * CHUNK, c * CHUNK + CHUNK, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        mask = cols < V
        x = tl.load(L + row * stride_l + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.where(mask, tl.exp(x - m_safe), 0.0), axis=0)
        m = m_new
        if temp > 0.0:
            u = tl.rand(seed, cols)
            u = tl.minimum(tl.maximum(u, 1e-20), 1.0 - 1e-7)
            score = x * inv_t - tl.log(-tl.log(u))
        else:
            score = x
        if HAS_MASK:  # a token the row's grammar forbids never wins; the log-sum-exp stays the raw logits'
            words = tl.load(MASK + tl.maximum(mask_row, 0) * stride_m + cols // 32, mask=mask, other=0)
            mask = mask & ((((words >> (cols % 32)) & 1) != 0) | (mask_row < 0))
        score = tl.where(mask, score, float("-inf"))
        cand = tl.max(score, axis=0)
        cand_idx = tl.min(tl.where(score == cand, cols, V), axis=0)
        take = cand > best
        best_idx = tl.where(take, cand_idx, best_idx)
        best = tl.where(take, cand, best)
    out = row * num_chunks + c
    tl.store(PART_M + out, m)
    tl.store(PART_S + out, s)
    tl.store(PART_BEST + out, best)
    tl.store(PART_IDX + out, best_idx)


@triton.jit
def _sample_combine_kernel(PART_M, PART_S, PART_BEST, PART_IDX, L, TOKENS, LSE, PACKED, num_chunks, stride_l,
                           BLOCK_C: tl.constexpr, PDL: tl.constexpr, pdl_early):
    pdl_start(PDL, pdl_early)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    mask = c < num_chunks
    base = row * num_chunks
    m = tl.load(PART_M + base + c, mask=mask, other=float("-inf"))
    s = tl.load(PART_S + base + c, mask=mask, other=0.0)
    best = tl.load(PART_BEST + base + c, mask=mask, other=float("-inf"))
    idx = tl.load(PART_IDX + base + c, mask=mask, other=0)
    m_all = tl.max(m, axis=0)
    total = tl.sum(tl.where(mask, s * tl.exp(m - m_all), 0.0), axis=0)
    b = tl.max(best, axis=0)
    first = tl.min(tl.where(best == b, c, BLOCK_C), axis=0)  # lowest chunk among ties = lowest index
    token = tl.sum(tl.where(c == first, idx, 0), axis=0).to(tl.int64)
    lse = m_all + tl.log(total)
    tl.store(TOKENS + row, token)
    tl.store(LSE + row, lse)
    # (token, its logprob under the raw distribution): the one row the host reads back
    logprob = tl.load(L + row * stride_l + token).to(tl.float32) - lse
    tl.store(PACKED + row * 2, token.to(tl.float64))
    tl.store(PACKED + row * 2 + 1, logprob.to(tl.float64))


def sample(logits: torch.Tensor, seeds: torch.Tensor, temperatures: torch.Tensor, masks: torch.Tensor | None = None,
           mask_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (token ids ``[B]``, log-sum-exp of the raw logits ``[B]``, ``[B, 2]`` float64 rows of
    (token, log p(token) under the raw distribution)); ``seeds`` are the per-row mixed (request
    seed, position) keys (int64, < 2**63); logits in any float dtype (read as fp32). ``masks``:
    int32 ``[M, ceil(V / 32)]`` grammar bitmasks (bit t % 32 of word t // 32: token t allowed);
    row i draws among the tokens of mask row ``mask_rows[i]`` (none where it is -1; ``mask_rows``
    None: mask row i). Each row is split into fixed vocabulary chunks combined in chunk order, and
    reads only its own logits, key and mask row, so a row's result never depends on the batch."""
    rows, vocab = logits.shape
    dev = logits.device
    tokens = torch.empty(rows, dtype=torch.int64, device=dev)
    lse = torch.empty(rows, dtype=torch.float32, device=dev)
    packed = torch.empty((rows, 2), dtype=torch.float64, device=dev)
    if rows == 0:
        return tokens, lse, packed
    if masks is not None:
        assert masks.dtype == torch.int32 and masks.shape[-1] * 32 >= vocab and masks.stride(-1) == 1, \
            "sample: masks are int32 [M, ceil(V / 32)] rows"
        if mask_rows is None:
            assert masks.shape[0] >= rows, "sample: one mask row per logits row"
            mask_rows = torch.arange(rows, dtype=torch.int32, device=dev)
    chunk = min(CHUNK, triton.next_power_of_2(vocab))
    num_chunks = triton.cdiv(vocab, chunk)
    part = [torch.empty(rows * num_chunks, dtype=dt, device=dev)
            for dt in (torch.float32, torch.float32, torch.float32, torch.int32)]
    has_mask = masks is not None
    _sample_partial_kernel[(rows, num_chunks)](logits, seeds, temperatures, masks if has_mask else seeds,
                                               mask_rows if has_mask else seeds, *part, vocab, logits.stride(0),
                                               masks.stride(0) if has_mask else 0, num_chunks, CHUNK=chunk,
                                               BLOCK_V=min(2048, chunk), HAS_MASK=has_mask, num_warps=4, **pdl())
    _sample_combine_kernel[(rows,)](*part, logits, tokens, lse, packed, num_chunks, logits.stride(0),
                                    BLOCK_C=triton.next_power_of_2(num_chunks), num_warps=1, **pdl())
    return tokens, lse, packed
