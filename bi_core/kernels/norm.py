"""Row-wise RMSNorms: zero-centred with optional fused residual add, and the GDN gated norm.
One row per program, block = next power of two of the row length, fp32 accumulation. The
zero-centred norm can also write its output's block-FP8 copy (``rms_norm_fp8``): the output row in
the activation dtype, quantized per group of 128 columns by ``e4m3.quant_group``, the arithmetic
of ``fp8.quantize_act`` on the same values, so the same bits with one launch fewer."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bi_core.kernels.common import pdl, pdl_start
from bi_core.kernels.e4m3 import GROUP, quant_group

_GROUP = tl.constexpr(GROUP)  # the kernels' copy (a jitted function reads only constexpr globals)


@triton.jit
def _rms_norm_kernel(X, R, W, Y, R_OUT, YQ, YS, stride_x, stride_r, stride_y, stride_ro, stride_q, stride_s, N, eps,
                     HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
                     pdl_early):
    pdl_start(PDL, pdl_early)
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
    y = (xf * rstd * (1.0 + w)).to(Y.dtype.element_ty)
    tl.store(Y + row * stride_y + cols, y, mask=mask)
    if QUANT:  # the stored values (0 past N, as quantize_act loads them), group by group
        groups: tl.constexpr = BLOCK // _GROUP
        q, scale = quant_group(tl.reshape(y.to(tl.float32), (groups, _GROUP)))
        g = tl.arange(0, groups)
        qcols = g[:, None] * _GROUP + tl.arange(0, _GROUP)[None, :]
        tl.store(YQ + row * stride_q + qcols, q.to(YQ.dtype.element_ty), mask=qcols < N)
        tl.store(YS + row * stride_s + g, scale, mask=g * _GROUP < N)


@triton.jit
def _gated_rms_norm_kernel(X, G, W, Y, stride_x, stride_g, stride_y, N, eps, HEADS: tl.constexpr,
                           PER_PROGRAM: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr, pdl_early):
    pdl_start(PDL, pdl_early)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(Y.dtype.element_ty).to(tl.float32)
    for i in tl.static_range(PER_PROGRAM):  # each (row, head) alone, the same arithmetic however many
        row = tl.program_id(0).to(tl.int64) * PER_PROGRAM + i
        t, head = row // HEADS, row % HEADS  # HEADS groups of N in each strided row (a row of N when 1)
        xf = tl.load(X + t * stride_x + head * N + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
        # transformers' rounding: normalise, cast, times weight in the model dtype, times silu(gate) in fp32
        y = (xf * rstd).to(Y.dtype.element_ty).to(tl.float32)
        y = (w * y).to(Y.dtype.element_ty).to(tl.float32)
        g = tl.load(G + t * stride_g + head * N + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + t * stride_y + head * N + cols, (y * g * tl.sigmoid(g)).to(Y.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, quant: bool):
    """(y, x + residual or None, (y's e4m3 values, scales) or None), each ``[rows, ...]``."""
    n = x.shape[-1]
    x2 = _rows(x)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(n)
    if quant:
        block = max(block, GROUP)
        yq = torch.empty(x2.shape, dtype=torch.float8_e4m3fn, device=x.device)
        ys = torch.empty((x2.shape[0], triton.cdiv(n, GROUP)), dtype=torch.float32, device=x.device)
    else:
        yq = ys = y
    warps = 4 if block <= 2048 else 8
    r2 = r_out = None
    if residual is not None:
        r2 = _rows(residual)
        r_out = torch.empty_like(y)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, x2 if r2 is None else r2, weight, y, y if r_out is None else r_out, yq, ys, x2.stride(0),
            0 if r2 is None else r2.stride(0), y.stride(0), 0 if r_out is None else r_out.stride(0), yq.stride(0),
            ys.stride(0), n, eps, HAS_RESIDUAL=residual is not None, QUANT=quant, BLOCK=block, num_warps=warps,
            **pdl())
    return y, r_out, ((yq, ys) if quant else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Zero-centred RMSNorm over the last dim; with ``residual`` returns ``(norm(x + r), x + r)``."""
    y, r, _ = _launch(x, weight, eps, residual, quant=False)
    return y.view(x.shape) if residual is None else (y.view(x.shape), r.view(x.shape))


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """``rms_norm`` on rows ``x [T, K]`` that also returns the output's block-FP8 copy: ``(y, x + r
    or None, yq float8_e4m3fn [T, K], ys float32 [T, ceil(K / 128)])``, yq and ys bitwise
    ``fp8.quantize_act(y)``."""
    assert x.dim() == 2, "rms_norm_fp8: rows [T, K]"
    y, r, (yq, ys) = _launch(x, weight, eps, residual, quant=True)
    return y, r, yq, ys


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, *,
                   head_dim: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``w * rmsnorm(x) * silu(gate)`` over the last dim (GDN output norm). With ``head_dim``, x,
    gate and ``out`` are ``[T, heads * head_dim]`` rows (any row stride, e.g. columns of the
    in_proj output, rows of the layer output) normalised per head in place of a reshape copy;
    ``out`` goes with ``head_dim``."""
    if head_dim is None:
        assert out is None, "out= needs head_dim"
        shape, n = x.shape, x.shape[-1]
        x2, g2 = _rows(x), _rows(gate)
        y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
        heads = 1
    else:
        assert x.dim() == 2 and x.shape == gate.shape and x.shape[1] % head_dim == 0
        assert x.stride(1) == 1 and gate.stride(1) == 1
        shape, n, x2, g2 = x.shape, head_dim, x, gate
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
        assert y.shape == x.shape and y.stride(1) == 1
        heads = x.shape[1] // head_dim
    rows = x2.shape[0] * heads
    per = 8 if heads % 8 == 0 else 1  # (row, head) pairs a program normalises: 8 heads of one row
    if rows:
        _gated_rms_norm_kernel[(rows // per,)](x2, g2, weight, y, x2.stride(0), g2.stride(0), y.stride(0), n, eps,
                                               HEADS=heads, PER_PROGRAM=per, BLOCK=triton.next_power_of_2(n),
                                               num_warps=4, **pdl())
    return y.view(shape)
