"""Gated DeltaNet, recurrent (decode / verify) form, the whole mixer core: causal conv1d (width 4)
+ SiLU, the gates (``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)``), q/k L2
norm, the delta rule on the fp32 state, and the gated RMSNorm of the output, reading the in_proj
output ``[T, qkv | z | b | a]`` directly.

One arithmetic, two launch shapes (the same bits, checked bitwise on the GPU), chosen by the
number of sequences:
- up to ``SPLIT_MAX_SEQS`` sequences (``SPLIT_MAX_SEQS_PER_TOKEN`` in verify steps), two
  kernels: the conv of a block of channels per program, into a scratch buffer, then one program
  per (sequence, value head) for the recurrence. The value heads of a key head share its q/k
  conv windows, which a single kernel split by value head would read and write from several
  programs, hence the separate conv. At batch 1 this runs 32 recurrence programs, not 16;
- above it, one kernel per (sequence, key head): the conv of its channels (q and k of that key
  head, v of its GROUP value heads), then the recurrence of each of its value heads, the first
  one's state read before the conv. Fewer, longer programs stream the state faster at large
  batch (timings: docs/benchmarks.md section 19).
The recurrence runs over the sequence's tokens (one for a decode step, 1+N for a verify step,
or a whole continuation when scoring exactly): the same arithmetic per token whatever the step;
a state kept in bf16 is rounded after every token, as separate steps would store it. Every conv
window and state tile is read and written by one program only. State and window are read from
the sequence's read slot and stored to its last token's slot, or with ``per_token`` after every
token (speculative verify keeps the state of every draft; see ``runtime/batch.py``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bi_core.kernels.common import pdl, pdl_start

NUM_WARPS = 4  # the recurrence's: beats 8 and 16 at large batch, equal at B=1 (benchmarks sections 5, 12, 15)
BLOCK_C = 128  # split shape: conv channels per program (a speed knob: no bit moves)
CONV_WARPS = 4
# the split shape up to this many sequences (gdn_sweep.py, H200: at 1 token the split wins to B=4 and
# ties at 8; at 4 tokens a sequence, a verify step, it wins to B=8 and loses from 16)
SPLIT_MAX_SEQS = 4
SPLIT_MAX_SEQS_PER_TOKEN = 8


@triton.jit
def _store_window(ptr, h0, h1, h2, mask):
    dt = ptr.dtype.element_ty
    tl.store(ptr + 0, h0.to(dt), mask=mask)
    tl.store(ptr + 1, h1.to(dt), mask=mask)
    tl.store(ptr + 2, h2.to(dt), mask=mask)


@triton.jit
def _seq(SEQ_IDS, CU, CTX, SLOTS):
    """Program row -> (first token, end, whether it continues a past, its read slot)."""
    s = tl.load(SEQ_IDS + tl.program_id(0)).to(tl.int64)
    start = tl.load(CU + s).to(tl.int64)
    end = tl.load(CU + s + 1).to(tl.int64)
    has_past = tl.load(CTX + s) - (end - start) > 0  # a new sequence starts from zeros
    return start, end, has_past, tl.load(SLOTS + s).to(tl.int64)


@triton.jit
def _conv(PROJ, CONV_W, CONV, QKV, TOKEN_SLOTS, c, ok, start, end, has_past, slot, stride_p, stride_cs, stride_cc,
          CONV_DIM: tl.constexpr, PER_TOKEN: tl.constexpr):
    """The conv + SiLU of channels ``c`` over the tokens, outputs rounded to the scratch ``QKV
    [T, conv_dim]``'s dtype; the window read from ``slot``, stored per token or after the last."""
    dt = QKV.dtype.element_ty
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
        tl.store(QKV + t * CONV_DIM + c, (y * tl.sigmoid(y)).to(dt), mask=ok)  # silu, rounded
        h0, h1, h2 = h1, h2, x
        if PER_TOKEN:
            _store_window(CONV + tl.load(TOKEN_SLOTS + t).to(tl.int64) * stride_cs + c * stride_cc, h0, h1, h2, ok)
    if not PER_TOKEN:
        _store_window(CONV + tl.load(TOKEN_SLOTS + end - 1).to(tl.int64) * stride_cs + c * stride_cc, h0, h1, h2, ok)


@triton.jit
def _recurrence(PROJ, A_LOG, DT_BIAS, NORM_W, STATE, OUT, QKV, TOKEN_SLOTS, h, hv, hk, start, end, stride_p, stride_o,
                stride_ss, stride_sh, scale, eps, NUM_V_HEADS: tl.constexpr, KEY_DIM: tl.constexpr,
                VALUE_DIM: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, PER_TOKEN: tl.constexpr,
                ROUND_STATE: tl.constexpr):
    """Value head ``hv`` from state ``h`` (fp32 [DV, DK]): gates, L2 norms, the delta rule and the
    gated norm, token by token, q and k of key head ``hk`` and its v from the conv's scratch."""
    dt = OUT.dtype.element_ty
    conv_dim: tl.constexpr = 2 * KEY_DIM + VALUE_DIM
    dk = tl.arange(0, DK)
    dv = tl.arange(0, DV)
    tile = dv[:, None] * DK + dk[None, :]  # int32 offsets inside one head's state, stored transposed [DV, DK]
    head = STATE + hv * stride_sh
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


@triton.jit
def _state_tile(STATE, hv, slot, has_past, stride_ss, stride_sh, DK: tl.constexpr, DV: tl.constexpr):
    tile = tl.arange(0, DV)[:, None] * DK + tl.arange(0, DK)[None, :]
    return tl.where(has_past, tl.load(STATE + hv * stride_sh + slot * stride_ss + tile).to(tl.float32), 0.0)


@triton.jit
def _gdn_conv_kernel(PROJ, CONV_W, CONV, QKV, CU, CTX, SLOTS, TOKEN_SLOTS, SEQ_IDS, stride_p, stride_cs, stride_cc,
                     CONV_DIM: tl.constexpr, PER_TOKEN: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr, pdl_early):
    """Split shape, first kernel: channels [pid(1) * BLOCK_C, +BLOCK_C) of one sequence."""
    pdl_start(PDL, pdl_early)
    start, end, has_past, slot = _seq(SEQ_IDS, CU, CTX, SLOTS)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    _conv(PROJ, CONV_W, CONV, QKV, TOKEN_SLOTS, c, c < CONV_DIM, start, end, has_past, slot, stride_p, stride_cs,
          stride_cc, CONV_DIM, PER_TOKEN)


@triton.jit
def _gdn_recurrence_kernel(PROJ, A_LOG, DT_BIAS, NORM_W, STATE, OUT, QKV, CU, CTX, SLOTS, TOKEN_SLOTS, SEQ_IDS,
                           stride_p, stride_o, stride_ss, stride_sh, scale, eps,
                           NUM_V_HEADS: tl.constexpr, KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
                           GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, PER_TOKEN: tl.constexpr,
                           ROUND_STATE: tl.constexpr, PDL: tl.constexpr, pdl_early):
    """Split shape, second kernel: value head pid(1) of one sequence."""
    pdl_start(PDL, pdl_early)
    start, end, has_past, slot = _seq(SEQ_IDS, CU, CTX, SLOTS)
    hv = tl.program_id(1)
    h = _state_tile(STATE, hv, slot, has_past, stride_ss, stride_sh, DK, DV)
    _recurrence(PROJ, A_LOG, DT_BIAS, NORM_W, STATE, OUT, QKV, TOKEN_SLOTS, h, hv, hv // GROUP, start, end, stride_p,
                stride_o, stride_ss, stride_sh, scale, eps, NUM_V_HEADS, KEY_DIM, VALUE_DIM, DK, DV, PER_TOKEN,
                ROUND_STATE)


@triton.jit
def _gdn_fused_kernel(PROJ, CONV_W, A_LOG, DT_BIAS, NORM_W, CONV, STATE, OUT, QKV, CU, CTX, SLOTS, TOKEN_SLOTS,
                      SEQ_IDS, stride_p, stride_o, stride_cs, stride_cc, stride_ss, stride_sh, scale, eps,
                      NUM_V_HEADS: tl.constexpr, KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
                      GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, CHANNELS: tl.constexpr,
                      PER_TOKEN: tl.constexpr, ROUND_STATE: tl.constexpr, PDL: tl.constexpr, pdl_early):
    """Fused shape: key head pid(1) of one sequence, its channels' conv then its value heads."""
    pdl_start(PDL, pdl_early)
    start, end, has_past, slot = _seq(SEQ_IDS, CU, CTX, SLOTS)
    hk = tl.program_id(1)
    h_first = _state_tile(STATE, hk * GROUP, slot, has_past, stride_ss, stride_sh, DK, DV)  # overlaps the conv
    i = tl.arange(0, CHANNELS)  # q and k of key head hk, then v of its value heads
    c = tl.where(i < DK, hk * DK + i,
                 tl.where(i < 2 * DK, KEY_DIM + hk * DK + i - DK, 2 * KEY_DIM + hk * GROUP * DV + i - 2 * DK))
    _conv(PROJ, CONV_W, CONV, QKV, TOKEN_SLOTS, c, i < 2 * DK + GROUP * DV, start, end, has_past, slot, stride_p,
          stride_cs, stride_cc, 2 * KEY_DIM + VALUE_DIM, PER_TOKEN)
    tl.debug_barrier()  # the recurrence reads what other threads of this program wrote
    for g in tl.static_range(GROUP):
        hv = hk * GROUP + g
        h = h_first if g == 0 else _state_tile(STATE, hv, slot, has_past, stride_ss, stride_sh, DK, DV)
        _recurrence(PROJ, A_LOG, DT_BIAS, NORM_W, STATE, OUT, QKV, TOKEN_SLOTS, h, hv, hk, start, end, stride_p,
                    stride_o, stride_ss, stride_sh, scale, eps, NUM_V_HEADS, KEY_DIM, VALUE_DIM, DK, DV, PER_TOKEN,
                    ROUND_STATE)


def gdn_decode(proj: torch.Tensor, conv_weight: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
               norm_weight: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor, cu_seqlens: torch.Tensor,
               context_lens: torch.Tensor, slots: torch.Tensor, token_slots: torch.Tensor, seq_ids: torch.Tensor,
               out: torch.Tensor, *, num_k_heads: int, head_k_dim: int, eps: float, per_token: bool,
               config: dict | None = None) -> torch.Tensor:
    """``proj [T, qkv | z | b | a]`` -> gated-normed ``out [T, Hv*Dv]`` rows of the sequences
    ``seq_ids``; conv state ``[slots, conv_dim, 3]`` and fp32 (or bf16) state
    updated in place, both as the cache stores them (S transposed: ``[slots, Hv, Dv, Dk]``).
    ``config`` overrides the launch shape (``split``: True / False) and ``num_warps`` (the
    recurrence's), ``BLOCK_C`` / ``conv_warps`` (the split conv's; benchmarks, tests)."""
    num_v_heads, head_v_dim, _ = state.shape[1:]
    key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
    assert proj.stride(-1) == 1 and conv_weight.shape[1] == 4 and state.is_contiguous()
    assert conv_state.stride(2) == 1
    n = seq_ids.shape[0]
    if n:
        split = n <= (SPLIT_MAX_SEQS_PER_TOKEN if per_token else SPLIT_MAX_SEQS)
        cfg = {"BLOCK_C": BLOCK_C, "conv_warps": CONV_WARPS, "num_warps": NUM_WARPS, "split": split, **(config or {})}
        conv_dim, group = 2 * key_dim + value_dim, num_v_heads // num_k_heads
        qkv = torch.empty((proj.shape[0], conv_dim), dtype=out.dtype, device=proj.device)
        shape = dict(NUM_V_HEADS=num_v_heads, KEY_DIM=key_dim, VALUE_DIM=value_dim, GROUP=group, DK=head_k_dim,
                     DV=head_v_dim, PER_TOKEN=per_token, ROUND_STATE=state.dtype != torch.float32,
                     num_warps=cfg["num_warps"])
        if cfg["split"]:
            _gdn_conv_kernel[(n, triton.cdiv(conv_dim, cfg["BLOCK_C"]))](
                proj, conv_weight, conv_state, qkv, cu_seqlens, context_lens, slots, token_slots, seq_ids,
                proj.stride(0), conv_state.stride(0), conv_state.stride(1), CONV_DIM=conv_dim, PER_TOKEN=per_token,
                BLOCK_C=cfg["BLOCK_C"], num_warps=cfg["conv_warps"], **pdl())
            _gdn_recurrence_kernel[(n, num_v_heads)](
                proj, a_log, dt_bias, norm_weight, state, out, qkv, cu_seqlens, context_lens, slots, token_slots,
                seq_ids, proj.stride(0), out.stride(0), state.stride(0), state.stride(1), head_k_dim**-0.5, eps,
                **shape, **pdl())
        else:
            _gdn_fused_kernel[(n, num_k_heads)](
                proj, conv_weight, a_log, dt_bias, norm_weight, conv_state, state, out, qkv, cu_seqlens,
                context_lens, slots, token_slots, seq_ids, proj.stride(0), out.stride(0), conv_state.stride(0),
                conv_state.stride(1), state.stride(0), state.stride(1), head_k_dim**-0.5, eps,
                CHANNELS=triton.next_power_of_2(2 * head_k_dim + group * head_v_dim), **shape, **pdl())
    return out
