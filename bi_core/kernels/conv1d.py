"""Causal depthwise conv1d (width 4) + SiLU over a ragged batch with per-sequence state slots.

One program per (sequence, channel block, run of ``chunk`` tokens) walks its tokens with a
sliding window in registers. A run's window starts from the three inputs before it: pre-conv
rows of this step, or the sequence's stored window (the last 3 pre-conv rows of its past; zeros
for a new sequence). Every output is the same four-tap sum whichever program computes it, so
the token split changes no bit. The first run is the only reader of the stored window (runs are
at least 3 tokens long) and writes the new one (the last 3 inputs), so no program reads a window
another program rewrites. With
``per_token`` (speculative verify keeps the state after each draft) the window after every token
goes to that token's slot; those slots can include the read slot, so a sequence then runs in one
program."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bi_core.kernels.common import pdl, pdl_start

CHUNK_TOKENS = 16  # tokens per program in a prefill step (a speed knob: no bit moves; its loop is
# latency-bound, so short runs over more programs beat 64-token ones: benchmarks sections 12, 15)


@triton.jit
def _input(X, STATE_ROW, i, start, has_past, stride_x, c, mask):
    """Entry ``i`` of the sequence's extended input: the stored window for i < 3 (zeros without
    a past), else pre-conv row ``start + i - 3`` of this step."""
    in_state = i < 3  # (scalar conditions go through tl.where: the CPU interpreter rejects mask & scalar)
    from_state = tl.load(STATE_ROW + i, mask=tl.where(in_state & has_past, mask, False), other=0.0)
    from_x = tl.load(X + (start + i - 3) * stride_x + c, mask=tl.where(in_state, False, mask), other=0.0)
    return tl.where(in_state, from_state.to(tl.float32), from_x.to(tl.float32))


@triton.jit
def _conv1d_kernel(X, W, STATE, OUT, CU, CTX, SLOTS, TOKEN_SLOTS, SEQ_IDS, VALID, stride_x, stride_o, stride_ss,
                   stride_sc, C, chunk, BLOCK_C: tl.constexpr, PER_TOKEN: tl.constexpr, HAS_VALID: tl.constexpr,
                   PDL: tl.constexpr, pdl_early):
    pdl_start(PDL, pdl_early)
    s = tl.load(SEQ_IDS + tl.program_id(0)).to(tl.int64)
    cb = tl.program_id(1)
    run = tl.program_id(2)
    start = tl.load(CU + s).to(tl.int64)
    end = tl.load(CU + s + 1).to(tl.int64)
    n = end - start
    lo = run * chunk  # this program's tokens: [lo, hi) of the sequence's n
    if lo < n:
        hi = tl.minimum(lo + chunk, n)
        has_past = tl.load(CTX + s) - n > 0  # a new sequence starts from zeros (its slot holds an old window)
        slot = tl.load(SLOTS + s).to(tl.int64)
        c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = c < C
        w0 = tl.load(W + c * 4 + 0, mask=mask, other=0.0).to(tl.float32)
        w1 = tl.load(W + c * 4 + 1, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(W + c * 4 + 2, mask=mask, other=0.0).to(tl.float32)
        w3 = tl.load(W + c * 4 + 3, mask=mask, other=0.0).to(tl.float32)
        base = STATE + slot * stride_ss + c * stride_sc
        cs = c * stride_sc
        h0 = _input(X, base, lo, start, has_past, stride_x, c, mask)
        h1 = _input(X, base, lo + 1, start, has_past, stride_x, c, mask)
        h2 = _input(X, base, lo + 2, start, has_past, stride_x, c, mask)
        if not PER_TOKEN:
            if run == 0:  # the only reader of the stored window writes the new one: the last 3 real inputs
                nv = n
                if HAS_VALID:  # rows past the sequence's valid tokens are padding (a graph's prompt piece)
                    nv = tl.load(VALID + s).to(tl.int64)
                e0 = _input(X, base, nv, start, has_past, stride_x, c, mask)
                e1 = _input(X, base, nv + 1, start, has_past, stride_x, c, mask)
                e2 = _input(X, base, nv + 2, start, has_past, stride_x, c, mask)
                dst = STATE + tl.load(TOKEN_SLOTS + end - 1) * stride_ss + cs
                tl.store(dst + 0, e0.to(STATE.dtype.element_ty), mask=mask)
                tl.store(dst + 1, e1.to(STATE.dtype.element_ty), mask=mask)
                tl.store(dst + 2, e2.to(STATE.dtype.element_ty), mask=mask)
        for t in range(start + lo, start + hi):
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


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, cu_seqlens: torch.Tensor,
                  context_lens: torch.Tensor, slots: torch.Tensor, token_slots: torch.Tensor, *,
                  per_token: bool = False, seq_ids: torch.Tensor | None = None, out: torch.Tensor | None = None,
                  block_c: int = 256, max_tokens: int | None = None, chunk: int = CHUNK_TOKENS,
                  valid: torch.Tensor | None = None) -> torch.Tensor:
    """``x [T, C]`` pre-conv rows, ``weight [C, 4]``, ``state [slots, C, 3]``: read from
    ``slots[seq]``, written to ``token_slots[t]``. ``seq_ids`` selects sequences (default: all).
    ``valid`` ``[B]``: a sequence's rows past ``valid[seq]`` are padding, so its stored window is
    taken from the rows before them (not with ``per_token``).
    ``max_tokens`` (host int, at least the longest selected sequence's tokens) lets a sequence's
    tokens spread over programs of ``chunk`` tokens; without it each sequence runs in one."""
    assert weight.shape[1] == 4 and x.stride(-1) == 1
    num_seqs = cu_seqlens.shape[0] - 1
    if seq_ids is None:
        seq_ids = torch.arange(num_seqs, device=x.device, dtype=torch.int32)
    out = torch.empty_like(x) if out is None else out
    if seq_ids.shape[0] == 0:
        return out
    assert chunk >= 3, "a run shorter than the window would read the stored window the first run rewrites"
    if per_token or max_tokens is None:
        chunk, runs = max(1, x.shape[0]), 1
    else:
        runs = triton.cdiv(max(1, max_tokens), chunk)
    channels = x.shape[1]
    grid = (seq_ids.shape[0], triton.cdiv(channels, block_c), runs)
    assert valid is None or not per_token, "padded sequences keep only their final window"
    _conv1d_kernel[grid](x, weight, state, out, cu_seqlens, context_lens, slots, token_slots, seq_ids,
                         seq_ids if valid is None else valid, x.stride(0), out.stride(0), state.stride(0),
                         state.stride(1), channels, chunk, BLOCK_C=block_c, PER_TOKEN=per_token,
                         HAS_VALID=valid is not None, num_warps=4, **pdl())
    return out
