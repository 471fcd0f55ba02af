"""Gated delta rule, recurrent form, over a ragged batch with per-sequence state slots.

One program per (sequence, value head, block of value dims) keeps its [Dk, BV] fp32 state tile
in registers and walks the sequence's tokens one by one: the same arithmetic for a one-token
decode step and for each token of a multi-token (verify) call. q/k L2 norm, q scaling and GVA
(value head h reads key head h // group) are done in-kernel. The state is read from the
sequence's read slot and stored to its last token's slot, or, with ``per_token``, after every
token to that token's slot (speculative verify then keeps the state of every draft)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gdn_recurrent_kernel(Q, K, V, G, BETA, STATE, OUT, CU, CTX, SLOTS, SEQ_IDS, TOKEN_SLOTS,
                          stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_gt, stride_bt, stride_ot, stride_oh, stride_ss, stride_sh,
                          scale, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                          PER_TOKEN: tl.constexpr):
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
    tile = hv * stride_sh + dk[:, None] * DV + dv[None, :]
    # a new sequence starts from a zero state (its slot holds an old sequence's state)
    h = tl.where(past > 0, tl.load(STATE + slot * stride_ss + tile).to(tl.float32), 0.0)
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
        if PER_TOKEN:
            tl.store(STATE + tl.load(TOKEN_SLOTS + t) * stride_ss + tile, h.to(STATE.dtype.element_ty))
    if not PER_TOKEN:
        tl.store(STATE + tl.load(TOKEN_SLOTS + end - 1) * stride_ss + tile, h.to(STATE.dtype.element_ty))


def gdn_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor, cu_seqlens: torch.Tensor, context_lens: torch.Tensor, slots: torch.Tensor,
                  token_slots: torch.Tensor, *, per_token: bool = False, seq_ids: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, block_v: int = 32) -> torch.Tensor:
    """q, k ``[T, Hk, Dk]``; v ``[T, Hv, Dv]``; g (log decay, fp32), beta ``[T, Hv]``;
    state ``[slots, Hv, Dk, Dv]`` (fp32, or bf16 to halve its traffic; math stays fp32): read from ``slots[seq]``, written to ``token_slots[t]``
    (every token with ``per_token``, else the last). Returns o ``[T, Hv, Dv]``."""
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
    _gdn_recurrent_kernel[grid](
        q, k, v, g, beta, state, out, cu_seqlens, context_lens, slots, seq_ids, token_slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        out.stride(0), out.stride(1), state.stride(0), state.stride(1), dk**-0.5,
        GROUP=num_v_heads // num_k_heads, DK=dk, DV=dv, BV=block_v, PER_TOKEN=per_token, num_warps=4)
    return out
