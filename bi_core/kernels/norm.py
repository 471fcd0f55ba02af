"""Row-wise RMSNorms: zero-centred with optional fused residual add, and the GDN gated norm.
One row per program, block = next power of two of the row length, fp32 accumulation."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bi_core.kernels.common import pdl, pdl_start


@triton.jit
def _rms_norm_kernel(X, R, W, Y, R_OUT, stride_x, stride_r, stride_y, stride_ro, N, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)  # one rounding, like torch
        tl.store(R_OUT + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (xf * rstd * (1.0 + w)).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _gated_rms_norm_kernel(X, G, W, Y, stride_x, stride_g, stride_y, N, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    xf = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    # transformers' rounding: normalise, cast, times weight in the model dtype, times silu(gate) in fp32
    y = (xf * rstd).to(Y.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(Y.dtype.element_ty).to(tl.float32)
    y = (w * y).to(Y.dtype.element_ty).to(tl.float32)
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (y * g * tl.sigmoid(g)).to(Y.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Zero-centred RMSNorm over the last dim; with ``residual`` returns ``(norm(x + r), x + r)``."""
    shape, n = x.shape, x.shape[-1]
    x2 = _rows(x)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(n)
    warps = 4 if block <= 2048 else 8
    if residual is None:
        _rms_norm_kernel[(x2.shape[0],)](x2, x2, weight, y, y, x2.stride(0), 0, y.stride(0), 0, n, eps,
                                         HAS_RESIDUAL=False, BLOCK=block, num_warps=warps, **pdl())
        return y.view(shape)
    r2 = _rows(residual)
    r_out = torch.empty_like(y)
    _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, y, r_out, x2.stride(0), r2.stride(0), y.stride(0),
                                     r_out.stride(0), n, eps, HAS_RESIDUAL=True, BLOCK=block, num_warps=warps, **pdl())
    return y.view(shape), r_out.view(shape)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``w * rmsnorm(x) * silu(gate)`` over the last dim (GDN output norm)."""
    shape, n = x.shape, x.shape[-1]
    x2, g2 = _rows(x), _rows(gate)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    _gated_rms_norm_kernel[(x2.shape[0],)](x2, g2, weight, y, x2.stride(0), g2.stride(0), y.stride(0), n, eps,
                                           BLOCK=triton.next_power_of_2(n), num_warps=4, **pdl())
    return y.view(shape)
