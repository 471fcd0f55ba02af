"""Causal depthwise conv1d (width 4) + SiLU over a ragged batch with per-sequence state slots.

One program per (sequence, channel block) walks that sequence's tokens with a sliding window
in registers. The window (the last 3 pre-conv rows) is read from the sequence's read slot and
stored to the slot of its last token, or, with ``per_token``, after every token to that token's
slot (speculative verify keeps the state after each draft)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bi_core.kernels.common import pdl, pdl_start


@triton.jit
def _conv1d_kernel(X, W, STATE, OUT, CU, CTX, SLOTS, TOKEN_SLOTS, SEQ_IDS, stride_x, stride_o, stride_ss, stride_sc,
                   C, BLOCK_C: tl.constexpr, PER_TOKEN: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    s = tl.load(SEQ_IDS + tl.program_id(0)).to(tl.int64)
    cb = tl.program_id(1)
    start = tl.load(CU + s).to(tl.int64)
    end = tl.load(CU + s + 1).to(tl.int64)
    past = tl.load(CTX + s) - (end - start)
    slot = tl.load(SLOTS + s).to(tl.int64)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = c < C
    w0 = tl.load(W + c * 4 + 0, mask=mask, other=0.0).to(tl.float32)
    w1 = tl.load(W + c * 4 + 1, mask=mask, other=0.0).to(tl.float32)
    w2 = tl.load(W + c * 4 + 2, mask=mask, other=0.0).to(tl.float32)
    w3 = tl.load(W + c * 4 + 3, mask=mask, other=0.0).to(tl.float32)
    base = STATE + slot * stride_ss + c * stride_sc
    cs = c * stride_sc
    # a new sequence starts from zeros (its slot holds an old sequence's window)
    h0 = tl.where(past > 0, tl.load(base + 0, mask=mask, other=0.0).to(tl.float32), 0.0)
    h1 = tl.where(past > 0, tl.load(base + 1, mask=mask, other=0.0).to(tl.float32), 0.0)
    h2 = tl.where(past > 0, tl.load(base + 2, mask=mask, other=0.0).to(tl.float32), 0.0)
    for t in range(start, end):
        x = tl.load(X + t * stride_x + c, mask=mask, other=0.0).to(tl.float32)
        acc = w0 * h0 + w1 * h1 + w2 * h2 + w3 * x
        y = acc.to(OUT.dtype.element_ty).to(tl.float32)
        tl.store(OUT + t * stride_o + c, (y * tl.sigmoid(y)).to(OUT.dtype.element_ty), mask=mask)
        h0, h1, h2 = h1, h2, x
        if PER_TOKEN:
            dst = STATE + tl.load(TOKEN_SLOTS + t) * stride_ss + cs
            tl.store(dst + 0, h0.to(STATE.dtype.element_ty), mask=mask)
            tl.store(dst + 1, h1.to(STATE.dtype.element_ty), mask=mask)
            tl.store(dst + 2, h2.to(STATE.dtype.element_ty), mask=mask)
    if not PER_TOKEN:
        dst = STATE + tl.load(TOKEN_SLOTS + end - 1) * stride_ss + cs
        tl.store(dst + 0, h0.to(STATE.dtype.element_ty), mask=mask)
        tl.store(dst + 1, h1.to(STATE.dtype.element_ty), mask=mask)
        tl.store(dst + 2, h2.to(STATE.dtype.element_ty), mask=mask)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, cu_seqlens: torch.Tensor,
                  context_lens: torch.Tensor, slots: torch.Tensor, token_slots: torch.Tensor, *,
                  per_token: bool = False, seq_ids: torch.Tensor | None = None, out: torch.Tensor | None = None,
                  block_c: int = 256) -> torch.Tensor:
    """``x [T, C]`` pre-conv rows, ``weight [C, 4]``, ``state [slots, C, 3]``: read from
    ``slots[seq]``, written to ``token_slots[t]``. ``seq_ids`` selects sequences (default: all)."""
    assert weight.shape[1] == 4 and x.stride(-1) == 1
    num_seqs = cu_seqlens.shape[0] - 1
    if seq_ids is None:
        seq_ids = torch.arange(num_seqs, device=x.device, dtype=torch.int32)
    out = torch.empty_like(x) if out is None else out
    if seq_ids.shape[0] == 0:
        return out
    channels = x.shape[1]
    grid = (seq_ids.shape[0], triton.cdiv(channels, block_c))
    _conv1d_kernel[grid](x, weight, state, out, cu_seqlens, context_lens, slots, token_slots, seq_ids, x.stride(0),
                         out.stride(0), state.stride(0), state.stride(1), channels, BLOCK_C=block_c,
                         PER_TOKEN=per_token, num_warps=4, **pdl())
    return out
