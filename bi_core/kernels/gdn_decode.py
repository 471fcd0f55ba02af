"""Gated DeltaNet, recurrent (decode / verify) form, the whole mixer core in one kernel:
causal conv1d (width 4) + SiLU, the gates (``beta = sigmoid(b)``, ``g = -exp(A_log) *
softplus(a + dt_bias)``), q/k L2 norm, the delta rule on the fp32 state, and the gated RMSNorm
of the output, reading the in_proj output ``[T, qkv | z | b | a]`` directly.

One program per (sequence, key head): first the conv of its channels (q and k of that key head,
v of the GROUP value heads sharing it) over the sequence's tokens into a scratch buffer, then,
per value head, the recurrence over the same tokens (one for a decode step, 1+N for a verify
step, or a whole continuation when scoring exactly): the same arithmetic per token whatever
the step; a state kept in bf16 is rounded after every token, as separate steps would store it. Every conv window and state tile is
read and written by one program only. State and window are read from the sequence's read slot and stored to
its last token's slot, or with ``per_token`` after every token (speculative verify keeps the
state of every draft; see ``runtime/batch.py``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bi_core.kernels.common import pdl, pdl_start

NUM_WARPS = 4  # beats 8 and 16 at large batch (occupancy), equal at B=1 (benchmarks sections 5, 12, 15)
PREFETCH = 1  # value heads whose state a program reads before the conv (a speed knob: no bit moves)


@triton.jit
def _store_window(ptr, h0, h1, h2, mask):
    dt = ptr.dtype.element_ty
    tl.store(ptr + 0, h0.to(dt), mask=mask)
    tl.store(ptr + 1, h1.to(dt), mask=mask)
    tl.store(ptr + 2, h2.to(dt), mask=mask)


@triton.jit
def _gdn_decode_kernel(PROJ, CONV_W, A_LOG, DT_BIAS, NORM_W, CONV, STATE, OUT, QKV, CU, CTX, SLOTS, TOKEN_SLOTS,
                       SEQ_IDS, stride_p, stride_o, stride_cs, stride_cc, stride_ss, stride_sh, scale, eps,
                       NUM_V_HEADS: tl.constexpr, KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
                       GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, CHANNELS: tl.constexpr,
                       PER_TOKEN: tl.constexpr, ROUND_STATE: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    s = tl.load(SEQ_IDS + tl.program_id(0)).to(tl.int64)
    hk = tl.program_id(1)
    dt = OUT.dtype.element_ty
    start = tl.load(CU + s).to(tl.int64)
    end = tl.load(CU + s + 1).to(tl.int64)
    has_past = tl.load(CTX + s) - (end - start) > 0  # a new sequence starts from zeros
    slot = tl.load(SLOTS + s).to(tl.int64)
    conv_dim: tl.constexpr = 2 * KEY_DIM + VALUE_DIM
    dk = tl.arange(0, DK)
    dv = tl.arange(0, DV)
    tile = dv[:, None] * DK + dk[None, :]  # int32 offsets inside one head's state, stored transposed [DV, DK]
    # the first PREFETCH value heads' states are read now: those reads overlap the conv below
    if PREFETCH >= 1:
        h_first = tl.load(STATE + (hk * GROUP) * stride_sh + slot * stride_ss + tile)
    if PREFETCH >= 2:
        h_second = tl.load(STATE + (hk * GROUP + 1) * stride_sh + slot * stride_ss + tile)
    # phase 1, the conv of this program's channels (q and k of key head hk, v of its value heads),
    # token by token, outputs to the QKV scratch; windows read and written by this program only
    i = tl.arange(0, CHANNELS)
    ok = i < 2 * DK + GROUP * DV
    c = tl.where(i < DK, hk * DK + i,
                 tl.where(i < 2 * DK, KEY_DIM + hk * DK + i - DK, 2 * KEY_DIM + hk * GROUP * DV + i - 2 * DK))
    w0 = tl.load(CONV_W + c * 4, mask=ok, other=0.0).to(tl.float32)
    w1 = tl.load(CONV_W + c * 4 + 1, mask=ok, other=0.0).to(tl.float32)
    w2 = tl.load(CONV_W + c * 4 + 2, mask=ok, other=0.0).to(tl.float32)
    w3 = tl.load(CONV_W + c * 4 + 3, mask=ok, other=0.0).to(tl.float32)
    window = CONV + slot * stride_cs + c * stride_cc
    h0 = tl.where(has_past, tl.load(window, mask=ok, other=0.0).to(tl.float32), 0.0)
    h1 = tl.where(has_past, tl.load(window + 1, mask=ok, other=0.0).to(tl.float32), 0.0)
    h2 = tl.where(has_past, tl.load(window + 2, mask=ok, other=0.0).to(tl.float32), 0.0)
    for t in range(start, end):
        x = tl.load(PROJ + t * stride_p + c, mask=ok, other=0.0).to(tl.float32)
        y = (w0 * h0 + w1 * h1 + w2 * h2 + w3 * x).to(dt).to(tl.float32)  # a conv output, in the model dtype
        tl.store(QKV + t * conv_dim + c, (y * tl.sigmoid(y)).to(dt), mask=ok)  # silu, rounded
        h0, h1, h2 = h1, h2, x
        if PER_TOKEN:
            _store_window(CONV + tl.load(TOKEN_SLOTS + t).to(tl.int64) * stride_cs + c * stride_cc, h0, h1, h2, ok)
    if not PER_TOKEN:
        _store_window(CONV + tl.load(TOKEN_SLOTS + end - 1).to(tl.int64) * stride_cs + c * stride_cc, h0, h1, h2, ok)
    tl.debug_barrier()  # phase 2 reads what other threads of this program wrote
    # phase 2, per value head: gates, L2 norms, the delta rule on the state tile, the gated norm
    for g in tl.static_range(GROUP):
        hv = hk * GROUP + g
        head = STATE + hv * stride_sh
        if PREFETCH >= 1 and g == 0:
            h = tl.where(has_past, h_first.to(tl.float32), 0.0)
        elif PREFETCH >= 2 and g == 1:
            h = tl.where(has_past, h_second.to(tl.float32), 0.0)
        else:
            h = tl.where(has_past, tl.load(head + slot * stride_ss + tile).to(tl.float32), 0.0)
        neg_a = -tl.exp(tl.load(A_LOG + hv).to(tl.float32))
        dt_bias = tl.load(DT_BIAS + hv).to(tl.float32)
        norm_w = tl.load(NORM_W + dv).to(dt).to(tl.float32)
        for t in range(start, end):
            row = PROJ + t * stride_p
            q = tl.load(QKV + t * conv_dim + hk * DK + dk).to(tl.float32)
            k = tl.load(QKV + t * conv_dim + KEY_DIM + hk * DK + dk).to(tl.float32)
            v = tl.load(QKV + t * conv_dim + 2 * KEY_DIM + hv * DV + dv).to(tl.float32)
            beta = tl.sigmoid(tl.load(row + conv_dim + VALUE_DIM + hv).to(tl.float32)).to(dt).to(tl.float32)
            x = tl.load(row + conv_dim + VALUE_DIM + NUM_V_HEADS + hv).to(tl.float32) + dt_bias
            softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
            q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
            k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
            # h is S transposed, [DV, DK]: S^T k and S^T q reduce over DK, the contiguous (in-warp) axis
            h = h * tl.exp(neg_a * softplus)
            u = (v - tl.sum(h * k[None, :], axis=1)) * beta
            h = h + u[:, None] * k[None, :]
            o = tl.sum(h * q[None, :], axis=1).to(dt).to(tl.float32)
            # gated RMSNorm, transformers' rounding: normalise, cast, times weight, times silu(z) in fp32
            rstd = 1.0 / tl.sqrt(tl.sum(o * o, axis=0) / DV + eps)
            y = (norm_w * (o * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            z = tl.load(row + conv_dim + hv * DV + dv).to(tl.float32)
            tl.store(OUT + t * stride_o + hv * DV + dv, (y * z * tl.sigmoid(z)).to(dt))
            if PER_TOKEN:
                dst = tl.load(TOKEN_SLOTS + t).to(tl.int64)
                tl.store(head + dst * stride_ss + tile, h.to(STATE.dtype.element_ty))
            if ROUND_STATE:  # a state stored narrower than fp32: the next token starts from the stored
                h = h.to(STATE.dtype.element_ty).to(tl.float32)  # value, as in a step of its own
        if not PER_TOKEN:
            dst = tl.load(TOKEN_SLOTS + end - 1).to(tl.int64)
            tl.store(head + dst * stride_ss + tile, h.to(STATE.dtype.element_ty))


def gdn_decode(proj: torch.Tensor, conv_weight: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
               norm_weight: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor, cu_seqlens: torch.Tensor,
               context_lens: torch.Tensor, slots: torch.Tensor, token_slots: torch.Tensor, seq_ids: torch.Tensor,
               out: torch.Tensor, *, num_k_heads: int, head_k_dim: int, eps: float, per_token: bool,
               config: dict | None = None) -> torch.Tensor:
    """``proj [T, qkv | z | b | a]`` -> gated-normed ``out [T, Hv*Dv]`` rows of the sequences
    ``seq_ids``; conv state ``[slots, conv_dim, 3]`` and fp32 (or bf16) state
    updated in place, both as the cache stores them (S transposed: ``[slots, Hv, Dv, Dk]``).
    ``config`` overrides ``PREFETCH`` / ``num_warps`` (benchmarks)."""
    num_v_heads, head_v_dim, _ = state.shape[1:]
    key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
    assert proj.stride(-1) == 1 and conv_weight.shape[1] == 4 and state.is_contiguous()
    assert conv_state.stride(2) == 1
    if seq_ids.shape[0]:
        group = num_v_heads // num_k_heads
        qkv = torch.empty((proj.shape[0], 2 * key_dim + value_dim), dtype=proj.dtype, device=proj.device)
        _gdn_decode_kernel[(seq_ids.shape[0], num_k_heads)](
            proj, conv_weight, a_log, dt_bias, norm_weight, conv_state, state, out, qkv, cu_seqlens, context_lens,
            slots, token_slots, seq_ids, proj.stride(0), out.stride(0), conv_state.stride(0), conv_state.stride(1),
            state.stride(0), state.stride(1), head_k_dim**-0.5, eps, NUM_V_HEADS=num_v_heads, KEY_DIM=key_dim,
            VALUE_DIM=value_dim, GROUP=group, DK=head_k_dim, DV=head_v_dim,
            CHANNELS=triton.next_power_of_2(2 * head_k_dim + group * head_v_dim), PER_TOKEN=per_token,
            ROUND_STATE=state.dtype != torch.float32,
            **{"PREFETCH": min(PREFETCH, group), "num_warps": NUM_WARPS, **(config or {})}, **pdl())
    return out
