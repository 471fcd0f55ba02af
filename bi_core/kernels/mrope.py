"""``qk_norm_rope``'s per-token kernel with M-RoPE (a step with images): each rotary frequency of
a token reads its own position (``ROPE_POS [T, ROT / 2]``: the t, h or w position its axis
gives, ``runtime/multimodal.py``). The same arithmetic per element as the 1-D kernel
(``_norm_rope``), so a text token, whose three axes agree, gets the 1-D kernel's bits."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bi_core.kernels.qk_norm_rope import _kv_value, _norm_rope


@triton.jit
def _qk_norm_mrope_kernel(QKV, QW, KW, INV_FREQ, ROPE_POS, SLOTS, QOUT, KC, VC, stride_t, stride_qt, stride_qh, eps,
                          k_inv, v_inv,
                          NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr,
                          KV_FP8: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    half: tl.constexpr = ROT // 2
    pos = tl.load(ROPE_POS + t * half + (d % half))  # each element its frequency's position
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


def qk_norm_mrope_write(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, inv_freq: torch.Tensor,
                        rope_positions: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, num_heads: int, eps: float, rotary_dim: int,
                        inv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """``qk_norm_rope_write`` with ``rope_positions [T, rotary_dim / 2]`` in place of positions."""
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2:]
    assert qkv.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert rope_positions.shape == (num_tokens, rotary_dim // 2) and rope_positions.is_contiguous()
    q = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens:
        _qk_norm_mrope_kernel[(num_tokens, num_heads + num_kv_heads)](
            qkv, q_norm, k_norm, inv_freq, rope_positions, slot_mapping, q, k_cache, v_cache, qkv.stride(0),
            q.stride(0), q.stride(1), eps, *inv_scales, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, D=head_dim,
            ROT=rotary_dim, KV_FP8=k_cache.dtype == torch.float8_e4m3fn, num_warps=2)
    return q
