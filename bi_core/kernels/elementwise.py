"""Row-wise fused elementwise kernels: SiLU-and-mul, and the MoE combine of k expert outputs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_mul_kernel(X, Y, N, stride_x, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + row * stride_x + N + cols, mask=mask, other=0.0).to(tl.float32)
    # torch's rounding: silu(g) rounds to the model dtype, then the product does
    s = (g * tl.sigmoid(g)).to(Y.dtype.element_ty).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (s * u).to(Y.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :N]) * x[:, N:]`` for ``x [T, 2N]``."""
    rows, n = x.shape[0], x.shape[1] // 2
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows:
        block = min(1024, triton.next_power_of_2(n))
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](x, y, n, x.stride(0), y.stride(0), BLOCK=block, num_warps=4)
    return y


@triton.jit
def _moe_combine_kernel(Y, W, OUT, H, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in tl.static_range(TOP_K):  # slot order, fp32
        w = tl.load(W + t * TOP_K + j).to(OUT.dtype.element_ty).to(tl.float32)
        y = tl.load(Y + (t * TOP_K + j) * H + cols, mask=mask, other=0.0).to(tl.float32)
        acc += (y * w).to(OUT.dtype.element_ty).to(tl.float32)
    tl.store(OUT + t * H + cols, acc.to(OUT.dtype.element_ty), mask=mask)


def moe_combine(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``Σ_j round(y[t, j] * w[t, j])`` in fp32 in slot order; y ``[T*k, H]``, weights ``[T, k]`` fp32."""
    rows, top_k = weights.shape
    h = y.shape[1]
    out = torch.empty((rows, h), dtype=y.dtype, device=y.device)
    if rows:
        block = min(1024, triton.next_power_of_2(h))
        _moe_combine_kernel[(rows, triton.cdiv(h, block))](y, weights.contiguous(), out, h, TOP_K=top_k, BLOCK=block,
                                                           num_warps=4)
    return out
