"""Router: softmax over expert logits, top-k by repeated argmax (ties to the lower expert id),
renormalised weights. One row per program."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bi_core.kernels.common import pdl, pdl_start


@triton.jit
def _softmax_topk_kernel(L, W, IDS, E, stride_l, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr, pdl_early):
    pdl_start(PDL, pdl_early)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    mask = cols < E
    x = tl.load(L + row * stride_l + cols, mask=mask, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(mask & (p == p), p, -1.0)  # a NaN row (a graph's padding) still picks experts in range
    total = 0.0
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, cols, BLOCK_E), axis=0)  # lowest id among equal maxima
        tl.store(W + row * TOP_K + j, best)
        tl.store(IDS + row * TOP_K + j, idx.to(tl.int64))
        total += best
        p = tl.where(cols == idx, -1.0, p)
    for j in tl.static_range(TOP_K):
        tl.store(W + row * TOP_K + j, tl.load(W + row * TOP_K + j) / total)


def softmax_topk(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, num_experts = logits.shape
    weights = torch.empty((rows, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((rows, top_k), dtype=torch.int64, device=logits.device)
    if rows:
        _softmax_topk_kernel[(rows,)](logits, weights, ids, num_experts, logits.stride(0), TOP_K=top_k,
                                     BLOCK_E=triton.next_power_of_2(num_experts), num_warps=4, **pdl())
    return weights, ids
