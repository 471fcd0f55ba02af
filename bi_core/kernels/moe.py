"""Routed MoE experts as two grouped GEMMs over (token, slot) pairs sorted by expert.

Routing (``align``) is plain, deterministic torch ops with static shapes (capturable in a CUDA
graph): pairs sorted stably by expert, each expert's run padded to BLOCK_M rows. The grouped
GEMM uses the fixed-K-order scheme of ``gemm.py``, so a pair's result does not depend on how
many pairs its expert received or where it sits in the tile. The k expert outputs of a token
are combined in fp32 in slot order."""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from bi_core.kernels.common import dot_mode, mma
from bi_core.kernels.elementwise import moe_combine, silu_mul
from bi_core.kernels.gemm import block_m_for


@attrs.frozen
class Routing:
    sorted_pairs: torch.Tensor  # [max_rows] int32, pair id (token * k + slot) or num_pairs for padding
    block_expert: torch.Tensor  # [max_blocks] int32, expert of each BLOCK_M rows (>= E: empty block)
    block_m: int
    num_pairs: int


def align(topk_ids: torch.Tensor, num_experts: int) -> Routing:
    flat = topk_ids.reshape(-1)
    num_pairs = flat.shape[0]
    bm = block_m_for(num_pairs)
    max_rows = min(num_pairs * bm, num_pairs + num_experts * (bm - 1))
    max_rows = triton.cdiv(max_rows, bm) * bm
    order = torch.argsort(flat, stable=True)
    # scatter_add, not bincount: bincount reads the max back to the host (no CUDA-graph capture)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + bm - 1) // bm * bm
    padded_end = torch.cumsum(padded, 0)
    expert_of = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - (torch.cumsum(counts, 0) - counts)[expert_of]
    dest = (padded_end - padded)[expert_of] + rank
    sorted_pairs = torch.full((max_rows,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, max_rows, bm, device=flat.device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)
    return Routing(sorted_pairs, block_expert, bm, num_pairs)


@triton.jit
def _grouped_gemm_kernel(A, W, C, SORTED, BLOCK_EXPERT, num_pairs, N, K, num_experts, stride_am, stride_we,
                         stride_wn, stride_cm, A_ROW_DIV: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr):
    b = tl.program_id(0)
    e = tl.load(BLOCK_EXPERT + b).to(tl.int64)
    if e >= num_experts:
        return
    pairs = tl.load(SORTED + b * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    a_rows = (pairs // A_ROW_DIV).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptr = A + a_rows[:, None] * stride_am + rk[None, :]
    w_ptr = W + e * stride_we + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptr, mask=valid[:, None] & (rk[None, :] + k0 < K), other=0.0)
        w = tl.load(w_ptr, mask=(rn[None, :] < N) & (rk[:, None] + k0 < K), other=0.0)
        acc = mma(a, w, acc, DOT)
        a_ptr += BLOCK_K
        w_ptr += BLOCK_K
    c_ptr = C + pairs[:, None].to(tl.int64) * stride_cm + rn[None, :]
    tl.store(c_ptr, acc.to(C.dtype.element_ty), mask=valid[:, None] & (rn[None, :] < N))


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, routing: Routing, a_row_div: int) -> torch.Tensor:
    """For every pair p: ``out[p] = a[p // a_row_div] @ w[expert(p)].T``; w ``[E, N, K]``."""
    num_experts, n, k = w.shape
    out = torch.empty((routing.num_pairs, n), dtype=a.dtype, device=a.device)
    block_n = 128 if n >= 128 else max(16, triton.next_power_of_2(n))
    grid = (routing.block_expert.shape[0], triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](a, w, out, routing.sorted_pairs, routing.block_expert, routing.num_pairs, n, k,
                               num_experts, a.stride(0), w.stride(0), w.stride(1), out.stride(0), A_ROW_DIV=a_row_div,
                               BLOCK_M=routing.block_m, BLOCK_N=block_n, BLOCK_K=64,
                               DOT=dot_mode(a.dtype), num_warps=4, num_stages=3)
    return out


def fused_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
              w2: torch.Tensor) -> torch.Tensor:
    """Σ_j w_j · SwiGLU-expert_{id_j}(x) per token, combined in fp32 in slot order."""
    num_tokens, top_k = topk_ids.shape
    routing = align(topk_ids, w13.shape[0])
    h = grouped_gemm(x, w13, routing, a_row_div=top_k)
    y = grouped_gemm(silu_mul(h), w2, routing, a_row_div=1)
    return moe_combine(y, topk_weights)
