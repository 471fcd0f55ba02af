"""Paged causal attention (GQA) for a ragged batch of prefill and decode rows in one kernel.

A program takes one tile of a sequence's query tokens for one KV head (rows = tokens x the
GROUP query heads sharing it) and walks that sequence's KV pages from the first in fixed
BLOCK_N steps with an online softmax. A query row's arithmetic depends only on its own
position and its sequence's KV: blocks past its position are fully masked and leave it exactly
unchanged, so a row computes the same bits as a decode row or inside any prefill tile."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bi_core.kernels.common import dot_mode, mma

M_ROWS = 64  # rows per program (tokens per tile = M_ROWS // GROUP)
BLOCK_N = 32


@triton.jit
def _paged_attention_kernel(Q, KC, VC, OUT, BT, CTX, CU, TILE_SEQ, TILE_START, scale_log2,
                            stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ko, stride_kh,
                            stride_bt, PAGE: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
                            M_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.load(TILE_SEQ + tile).to(tl.int64)
    t0 = tl.load(TILE_START + tile)
    q_start = tl.load(CU + s)
    q_len = tl.load(CU + s + 1) - q_start
    ctx = tl.load(CTX + s)
    past = ctx - q_len
    r = tl.arange(0, M_ROWS)
    tok = t0 + r // GROUP
    head = kvh * GROUP + r % GROUP
    row_ok = tok < q_len
    pos = past + tok
    d = tl.arange(0, D)
    q_ptr = Q + (q_start + tok)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr, mask=row_ok[:, None], other=0.0)
    kv_end = tl.minimum(ctx, past + t0 + M_ROWS // GROUP)
    m_i = tl.full((M_ROWS,), float("-inf"), tl.float32)
    l_i = tl.zeros((M_ROWS,), tl.float32)
    acc = tl.zeros((M_ROWS, D), tl.float32)
    for n0 in range(0, kv_end, BLOCK_N):
        idx = n0 + tl.arange(0, BLOCK_N)
        in_kv = idx < kv_end
        page = tl.load(BT + s * stride_bt + idx // PAGE, mask=in_kv, other=0).to(tl.int64)
        off = page * stride_kb + (idx % PAGE) * stride_ko + kvh * stride_kh
        k = tl.load(KC + off[:, None] + d[None, :], mask=in_kv[:, None], other=0.0)
        v = tl.load(VC + off[:, None] + d[None, :], mask=in_kv[:, None], other=0.0)
        scores = mma(q, tl.trans(k), tl.zeros((M_ROWS, BLOCK_N), tl.float32), DOT) * scale_log2
        visible = (idx[None, :] <= pos[:, None]) & in_kv[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None], DOT)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_ptr = OUT + (q_start + tok)[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=row_ok[:, None])


def tokens_per_tile(num_heads: int, num_kv_heads: int) -> int:
    return M_ROWS // (num_heads // num_kv_heads)


def make_tiles(query_lens: list[int], tile_tokens: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, first token) of every query tile; host-side, once per step."""
    seqs, starts = [], []
    for i, n in enumerate(query_lens):
        for t in range(0, n, tile_tokens):
            seqs.append(i)
            starts.append(t)
    return (torch.tensor(seqs, dtype=torch.int32, device=device),
            torch.tensor(starts, dtype=torch.int32, device=device))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, cu_seqlens: torch.Tensor, tile_seq: torch.Tensor,
                    tile_start: torch.Tensor, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """q ``[T, Hq, D]``; caches ``[blocks, page, Hkv, D]``; returns ``[T, Hq, D]``."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    assert M_ROWS % group == 0 and q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    out = torch.empty_like(q) if out is None else out
    grid = (tile_seq.shape[0], num_kv_heads)
    if grid[0] == 0:
        return out
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, context_lens, cu_seqlens, tile_seq, tile_start,
        scale * 1.4426950408889634, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        PAGE=page, GROUP=group, D=head_dim, M_ROWS=M_ROWS, BLOCK_N=BLOCK_N, DOT=dot_mode(q.dtype), num_warps=4, num_stages=2)
    return out
