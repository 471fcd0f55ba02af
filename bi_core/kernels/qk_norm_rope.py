"""Qwen3.5 gated attention, the per-token part: q/k zero-centred RMSNorm per head, partial NeoX
RoPE on the first ``ROT`` dims, k/v written to their KV-cache slots, q staged for attention, in
one kernel (one program per token and head, row-wise, so batch-invariant by construction).
Rounding follows transformers: normalised in fp32 then cast; cos/sin computed in fp32 then
cast; ``x*cos`` and ``rotate_half(x)*sin`` each rounded, then their sum.

Also the output gate for attention backends that return the plain attention output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bi_core.kernels.common import pdl, pdl_start
from bi_core.kernels.e4m3 import round_e4m3

_KV_FP8_MAX = tl.constexpr(448.0)  # ops/attention.py's KV_FP8_MAX (a jitted function reads constexpr globals only)


@triton.jit
def _norm_rope(X, W, d, pos, inv_freq_ptr, eps, D: tl.constexpr, ROT: tl.constexpr):
    """Row ``X[0:D]`` (a pointer) normalised and rotated; returns fp32 values already rounded to
    the model dtype."""
    dt = X.dtype.element_ty
    x = tl.load(X + d).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    y = (x * rstd * (1.0 + tl.load(W + d).to(tl.float32))).to(dt).to(tl.float32)
    half: tl.constexpr = ROT // 2
    partner = tl.where(d < half, d + half, d - half)
    in_rot = d < ROT
    xp = tl.load(X + partner, mask=in_rot, other=0.0).to(tl.float32)
    yp = (xp * rstd * (1.0 + tl.load(W + partner, mask=in_rot, other=0.0).to(tl.float32))).to(dt).to(tl.float32)
    freq = pos.to(tl.float32) * tl.load(inv_freq_ptr + (d % half), mask=in_rot, other=0.0)
    cos = tl.cos(freq).to(dt).to(tl.float32)
    sin = tl.sin(freq).to(dt).to(tl.float32)
    rotated = tl.where(d < half, -yp, yp)
    out = ((y * cos).to(dt).to(tl.float32) + (rotated * sin).to(dt).to(tl.float32)).to(dt)
    return tl.where(in_rot, out, y.to(dt))


@triton.jit
def _kv_value(x, inv_scale, KV_FP8: tl.constexpr):
    """A key or value as its cache stores it: as is, or (FP8 cache) times ``inv_scale`` (1 / the
    layer's k or v scale, as float32; 1: exact) clamped to +-448 and rounded to the nearest e4m3
    value in float32 arithmetic (``e4m3.round_e4m3``: the cast that follows is exact, on the GPU and
    under the interpreter alike)."""
    if KV_FP8:  # a constexpr branch each way, one return: the two values' types differ (bf16 models)
        y = round_e4m3(tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -_KV_FP8_MAX), _KV_FP8_MAX))
    else:
        y = x
    return y


@triton.jit
def _qk_norm_rope_kernel(QKV, QW, KW, INV_FREQ, POS, SLOTS, QOUT, KC, VC, stride_t, stride_qt, stride_qh, eps,
                         k_inv, v_inv,
                         NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr,
                         KV_FP8: tl.constexpr, PDL: tl.constexpr, pdl_early):
    pdl_start(PDL, pdl_early)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    pos = tl.load(POS + t)
    row = QKV + t * stride_t
    if h < NUM_HEADS:  # query head: [q | gate] per head, q first
        q = _norm_rope(row + h * 2 * D, QW, d, pos, INV_FREQ, eps, D, ROT)
        tl.store(QOUT + t * stride_qt + h * stride_qh + d, q)
    else:  # key head (normalised, rotated) and its value head, into the cache
        kvh = h - NUM_HEADS
        k = _norm_rope(row + 2 * NUM_HEADS * D + kvh * D, KW, d, pos, INV_FREQ, eps, D, ROT)
        v = tl.load(row + (2 * NUM_HEADS + NUM_KV_HEADS) * D + kvh * D + d)
        slot = tl.load(SLOTS + t).to(tl.int64)
        tl.store(KC + (slot * NUM_KV_HEADS + kvh) * D + d, _kv_value(k, k_inv, KV_FP8).to(KC.dtype.element_ty))
        tl.store(VC + (slot * NUM_KV_HEADS + kvh) * D + d, _kv_value(v, v_inv, KV_FP8).to(VC.dtype.element_ty))


def qk_norm_rope_write(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, inv_freq: torch.Tensor,
                       positions: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, num_heads: int, eps: float, rotary_dim: int,
                       inv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """``qkv [T, 2*Hq*D + 2*Hkv*D]`` -> q ``[T, Hq, D]`` (normalised, rotated); k, v into the caches
    ``[pages, page_size, Hkv, D]`` at ``slot_mapping`` (in the model dtype, or float8_e4m3fn at the
    scales whose float32 reciprocals ``inv_scales`` are: ops/attention.py's KV_CACHE_DTYPES)."""
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2:]
    assert qkv.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    q = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens:
        _qk_norm_rope_kernel[(num_tokens, num_heads + num_kv_heads)](
            qkv, q_norm, k_norm, inv_freq, positions, slot_mapping, q, k_cache, v_cache, qkv.stride(0),
            q.stride(0), q.stride(1), eps, *inv_scales, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, D=head_dim,
            ROT=rotary_dim, KV_FP8=k_cache.dtype == torch.float8_e4m3fn, num_warps=2, **pdl())
    return q


@triton.jit
def _gate_kernel(ATTN, G, OUT, stride_ot, stride_gt, stride_out, D: tl.constexpr, PDL: tl.constexpr, pdl_early):
    pdl_start(PDL, pdl_early)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    o = tl.load(ATTN + t * stride_ot + h * D + d).to(tl.float32)
    g = tl.sigmoid(tl.load(G + t * stride_gt + h * 2 * D + d).to(tl.float32)).to(OUT.dtype.element_ty)
    tl.store(OUT + t * stride_out + h * D + d, (o * g.to(tl.float32)).to(OUT.dtype.element_ty))


def apply_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``o [T, Hq, D] * sigmoid(gate)`` -> ``[T, Hq*D]``; head h's gate at ``gate[:, h*2D : h*2D + D]``."""
    num_tokens, num_heads, head_dim = o.shape
    out = torch.empty((num_tokens, num_heads * head_dim), dtype=o.dtype, device=o.device)
    if num_tokens:
        _gate_kernel[(num_tokens, num_heads)](o, gate, out, o.stride(0), gate.stride(0), out.stride(0), D=head_dim,
                                             num_warps=2, **pdl())
    return out
