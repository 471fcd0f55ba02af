"""The vision tower's kernels: a row-wise LayerNorm (bias included), and bidirectional attention
within each image over ``cu_seqlens``. Attention runs one program per (query tile of one image,
head); a tile reads its own image's keys only, in fixed ``BLOCK_N`` steps from the image's first
row, with fixed tile sizes: an image's rows come out the same bits whatever other images share
the launch, and wherever the image lies in it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bi_core.kernels.common import dot_mode, mma

BLOCK_M = 128  # query rows per program
BLOCK_N = 64  # key rows per step
NUM_WARPS, NUM_STAGES = 8, 3  # the launch's (fixed like the tiles; dev/probes/vision_attention_tune.py times others)
LOG2E = 1.4426950408889634


@triton.jit
def _layer_norm_kernel(X, W, B, Y, stride_x, stride_y, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / N
    xc = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / N + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (xc * rstd * w + b).to(Y.dtype.element_ty), mask=mask)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim, one row per program, float32 inside."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _layer_norm_kernel[(x2.shape[0],)](x2, weight, bias, y, x2.stride(0), y.stride(0), n, eps,
                                           BLOCK=triton.next_power_of_2(n), num_warps=4)
    return y.view(x.shape)


@triton.jit
def _vision_attention_kernel(Q, K, V, OUT, TILE_Q, TILE_FROM, TILE_LO, TILE_HI, stride_t, stride_h, stride_ot, stride_oh, scale_log2,
                             D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             DOT: tl.constexpr):
    tile = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    q0 = tl.load(TILE_Q + tile)
    first = tl.load(TILE_FROM + tile)  # where the key steps start: the image's first row (lo)
    lo = tl.load(TILE_LO + tile)
    hi = tl.load(TILE_HI + tile)
    rows = q0 + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    rmask, dmask = rows < hi, d < D
    q = tl.load(Q + rows[:, None] * stride_t + h * stride_h + d[None, :], mask=rmask[:, None] & dmask[None, :],
                other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(first, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        cmask = (cols >= lo) & (cols < hi)
        kv_mask = cmask[:, None] & dmask[None, :]
        k = tl.load(K + cols[:, None] * stride_t + h * stride_h + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + cols[:, None] * stride_t + h * stride_h + d[None, :], mask=kv_mask, other=0.0)
        s = mma(q, tl.trans(k), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), DOT) * scale_log2
        s = tl.where(cmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None], DOT)
        m = m_new
    out = acc / l_sum[:, None]
    tl.store(OUT + rows[:, None] * stride_ot + h * stride_oh + d[None, :], out.to(OUT.dtype.element_ty),
             mask=rmask[:, None] & dmask[None, :])


def image_tiles(cu_seqlens_host: list[int], device: torch.device, key_grid: int | None = None) -> torch.Tensor:
    """``[4, tiles]`` int64: each query tile's first row, where its key steps start, and its
    image's row range (lo, hi). The steps start at the image's first row; ``key_grid`` (tests'
    negative control only) starts them on a grid of the whole launch instead, so that an image's
    reduction order follows where it lies."""
    q0, first, lo, hi = [], [], [], []
    for a, b in zip(cu_seqlens_host[:-1], cu_seqlens_host[1:]):
        for start in range(a, b, BLOCK_M):
            q0.append(start)
            first.append(a if key_grid is None else a // key_grid * key_grid)
            lo.append(a)
            hi.append(b)
    return torch.tensor([q0, first, lo, hi], dtype=torch.int64).to(device)


def vision_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_host: list[int],
                     scale: float, key_grid: int | None = None) -> torch.Tensor:
    """``q, k, v [T, H, D]`` (same strides) -> ``[T, H, D]``, attention within each image."""
    t, heads, dim = q.shape
    assert q.stride() == k.stride() == v.stride() and q.stride(-1) == 1, "q, k, v: one layout, unit last stride"
    out = torch.empty((t, heads, dim), dtype=q.dtype, device=q.device)
    tiles = image_tiles(cu_seqlens_host, q.device, key_grid)
    if tiles.shape[1]:
        _vision_attention_kernel[(tiles.shape[1], heads)](
            q, k, v, out, tiles[0], tiles[1], tiles[2], tiles[3], q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            scale * LOG2E, D=dim, BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
            DOT=dot_mode(q.dtype), num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out
