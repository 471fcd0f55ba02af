"""Gated delta rule, recurrent form, over a ragged batch with per-sequence state slots.

One program per (sequence, value head, block of value dims) keeps its [Dk, BV] fp32 state tile
in registers and walks the sequence's tokens one by one: the same arithmetic for a one-token
decode step and for each token of a multi-token (verify) call. q/k L2 norm, q scaling and GVA
(value head h reads key head h // group) are done in-kernel. Optionally the state after every
token is stored (speculative verify commits the state of the last accepted token)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gdn_recurrent_kernel(Q, K, V, G, BETA, STATE, OUT, CU, CTX, SLOTS, SEQ_IDS, TOKEN_STATES,
                          stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_gt, stride_bt, stride_ot, stride_oh, stride_ss, stride_sh, stride_ts,
                          scale, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                          STORE_TOKEN_STATES: tl.constexpr):
    s = tl.load(SEQ_IDS + tl.program_id(0)).to(tl.int64)
    hv = tl.program_id(1)
    vb = tl.program_id(2)
    hk = hv // GROUP
    start = tl.load(CU + s).to(tl.int64)
    end = tl.load(CU + s + 1).to(tl.int64)
    past = tl.load(CTX + s) - (end - start)
    slot = tl.load(SLOTS + s).to(tl.int64)
    dk = tl.arange(0, DK)
    dv = vb * BV + tl.arange(0, BV)
    state_ptr = STATE + slot * stride_ss + hv * stride_sh + dk[:, None] * DV + dv[None, :]
    h = tl.load(state_ptr, mask=(dk[:, None] < DK) & (past > 0), other=0.0).to(tl.float32)
    for t in range(start, end):
        q = tl.load(Q + t * stride_qt + hk * stride_qh + dk).to(tl.float32)
        k = tl.load(K + t * stride_kt + hk * stride_kh + dk).to(tl.float32)
        v = tl.load(V + t * stride_vt + hv * stride_vh + dv).to(tl.float32)
        g = tl.load(G + t * stride_gt + hv).to(tl.float32)
        beta = tl.load(BETA + t * stride_bt + hv).to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        h = h * tl.exp(g)
        u = (v - tl.sum(h * k[:, None], axis=0)) * beta
        h = h + k[:, None] * u[None, :]
        o = tl.sum(h * q[:, None], axis=0)
        tl.store(OUT + t * stride_ot + hv * stride_oh + dv, o.to(OUT.dtype.element_ty))
        if STORE_TOKEN_STATES:
            tl.store(TOKEN_STATES + t * stride_ts + hv * stride_sh + dk[:, None] * DV + dv[None, :], h)
    tl.store(state_ptr, h)


def gdn_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor, cu_seqlens: torch.Tensor, context_lens: torch.Tensor, slots: torch.Tensor,
                  seq_ids: torch.Tensor | None = None, out: torch.Tensor | None = None,
                  token_states: torch.Tensor | None = None, block_v: int = 32) -> torch.Tensor:
    """q, k ``[T, Hk, Dk]``; v ``[T, Hv, Dv]``; g (log decay, fp32), beta ``[T, Hv]``;
    state ``[slots, Hv, Dk, Dv]`` fp32, updated in place; ``token_states [T, Hv, Dk, Dv]`` fp32
    receives the state after each token when given. Returns o ``[T, Hv, Dv]``."""
    num_tokens, num_k_heads, dk = q.shape
    num_v_heads, dv = v.shape[1:]
    num_seqs = cu_seqlens.shape[0] - 1
    if seq_ids is None:
        seq_ids = torch.arange(num_seqs, device=q.device, dtype=torch.int32)
    out = torch.empty_like(v) if out is None else out
    if seq_ids.shape[0] == 0:
        return out
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and state.is_contiguous()
    block_v = min(block_v, dv)
    grid = (seq_ids.shape[0], num_v_heads, triton.cdiv(dv, block_v))
    ts = token_states if token_states is not None else state
    _gdn_recurrent_kernel[grid](
        q, k, v, g, beta, state, out, cu_seqlens, context_lens, slots, seq_ids, ts,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        out.stride(0), out.stride(1), state.stride(0), state.stride(1), ts.stride(0), dk**-0.5,
        GROUP=num_v_heads // num_k_heads, DK=dk, DV=dv, BV=block_v, STORE_TOKEN_STATES=token_states is not None,
        num_warps=4)
    return out
