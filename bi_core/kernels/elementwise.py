"""Row-wise SiLU-and-mul (after a cuBLAS gate_up GEMM; the Triton GEMMs fuse it in their epilogue)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bi_core.kernels.common import pdl, pdl_start


@triton.jit
def _silu_mul_kernel(X, Y, N, stride_x, stride_y, BLOCK: tl.constexpr, PDL: tl.constexpr, pdl_early):
    pdl_start(PDL, pdl_early)
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
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](x, y, n, x.stride(0), y.stride(0), BLOCK=block,
                          num_warps=4, **pdl())
    return y
