"""Routed MoE experts in block FP8 (W8A8), batch-invariant: kernels/moe.py's sorted path with the
grouped GEMMs of fp8.py's arithmetic.

Layout (moe.py's, quantized): ``w13 [E, 2I, H]`` float8_e4m3fn (each expert's gate rows [0, I),
up rows [I, 2I); with a shared expert it is the last, E - 1), ``w13_scale [E, ceil(2I/128),
ceil(H/128)]`` float32 (I a multiple of 128, so no scale block mixes gate and up rows: the
checkpoints' per-expert gate_proj / up_proj ``weight_scale_inv`` stacked in that order);
``w2 [E, H, I]``, ``w2_scale [E, ceil(H/128), ceil(I/128)]``.

Arithmetic of a (token t, slot j) pair routed to expert e: x[t] quantized per group of 128
(``fp8.quantize_act``); gate and up each fp8.py's GEMM arithmetic (K blocks of 128 in ascending
order, ``acc = fma(dot * xs, ws, acc)``, no split), rounded with moe.py's epilogue (each GEMM
output, silu(gate), the product, in x's dtype); that row quantized per group of 128; the down
projection the same GEMM arithmetic, rounded to x's dtype; the token's k rows combined by
``moe.moe_combine`` (fp32, slot order, then the shared expert's gated output).

Invariance: routing is moe.py's (``align``: the pairs sorted by expert, each expert's run padded
to the routing block of 16..64 rows here (``ROUTE_BLOCK_MAX``), chosen from the pair count); a
pair's row is its own dot products in the same K order wherever it lands, whatever the routing
block, the tile, the way its weight tile is loaded (pointers or TMA) or the expert's row count.
Tiles are max(64, routing block) rows, or 16 rows with the dots swapped (per pair, and sorted
with routing blocks of 16), 64 or 128 weight rows as the wgmma's M side, so
every batch size runs the in-block dots on fp8 wgmma (fp8.py says why an unswapped tile below 64
rows would not). Tested bitwise under the interpreter with a K-ordered dot
(tests/kernels/test_fp8.py) and on an H200 at the 35B-A3B expert shapes; the per-pair tiles were
swept (benchmarks sections 20, 32 and 33).

API: ``fp8_fused_moe(x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale, shared_logits=None,
x_fp8=None)`` -> ``[T, H]`` in x's dtype (moe.fused_moe's arguments, plus the scales and, when a norm
wrote it, x's block-FP8 copy: ``quantize_act(x)``'s bits, its launch saved); ``fp8_grouped_gemm`` for
one grouped GEMM on pre-quantized rows. Up to PAIR_TOKENS tokens the experts run per pair
(``_fp8_moe_per_pair``: no routing sort, the same bits as the sorted path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bi_core.kernels.common import dot_mode, pdl, pdl_start
from bi_core.kernels.fp8 import (
    BLOCK,
    SWAP_BLOCK_M,
    _k_blocks,
    check_wgmma_tile,
    quantize_act,
)
from bi_core.kernels.gemm import MAX_LOCKS, _tma_ready, tile_locks
from bi_core.kernels.moe import Routing, _combine, _expert_of, align, moe_combine


@triton.jit
def _epilogue(acc, up, dt: tl.constexpr, SILU_MUL: tl.constexpr):
    """moe.py's rounding: each GEMM output in x's dtype, then silu(gate), then the product."""
    if SILU_MUL:  # rows [N, 2N) of the expert are the up projection
        gate = acc.to(dt).to(tl.float32)
        return ((gate * tl.sigmoid(gate)).to(dt).to(tl.float32) * up.to(dt).to(tl.float32)).to(dt)
    return acc.to(dt)


@triton.jit
def _block_pairs(SORTED, b, num_pairs, A_ROW_DIV: tl.constexpr, ROUTE_M: tl.constexpr, BLOCK_M: tl.constexpr):
    """Routing block b's pairs in the first ROUTE_M rows of a BLOCK_M-row tile: (pair ids, the real
    ones, their A rows ``pair // A_ROW_DIV``)."""
    r = tl.arange(0, BLOCK_M)
    pairs = tl.load(SORTED + b * ROUTE_M + r, mask=r < ROUTE_M, other=num_pairs)
    return pairs, pairs < num_pairs, (pairs // A_ROW_DIV).to(tl.int64)


@triton.jit
def _store_pairs(C, pairs, valid, rn, n_ok, acc, up, stride_cm, SILU_MUL: tl.constexpr):
    """The tile's outputs (``_epilogue``) into rows ``pairs`` of C."""
    out = _epilogue(acc, up, C.dtype.element_ty, SILU_MUL)
    tl.store(C + pairs[:, None].to(tl.int64) * stride_cm + rn[None, :], out, mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _expert_b(W, e, tile, stride_we, stride_wn, BLOCK_N: tl.constexpr, TMA: tl.constexpr):
    """Expert e's weights as ``_k_blocks``' B for column tile ``tile``: (B, B_ROW). TMA: W is a
    descriptor over the experts' weights as one [E * rows, K] matrix (contiguous: rows =
    stride_we // stride_wn) and B_ROW the tile's first row in it; else the pointer to expert e."""
    if TMA:  # (if/else: after an early return the compiler would still build W + ... for a descriptor)
        b, b_row = W, (e * (stride_we // stride_wn)).to(tl.int32) + tile * BLOCK_N
    else:
        b, b_row = W + e * stride_we, 0
    return b, b_row


@triton.jit(do_not_specialize=["num_pairs"])
def _fp8_grouped_kernel(A, AS, W, WS, C, SORTED, BLOCK_EXPERT, num_pairs, N, K, num_experts, stride_am, stride_asm,
                        stride_we, stride_wn, stride_wse, stride_wsn, stride_cm, A_ROW_DIV: tl.constexpr,
                        SILU_MUL: tl.constexpr, ROUTE_M: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, DOT: tl.constexpr, SWAP: tl.constexpr, TMA: tl.constexpr,
                        PDL: tl.constexpr, pdl_early):
    """Program (routing block b, column tile): the block's ROUTE_M pairs in the first rows of a
    BLOCK_M-row tile (BLOCK_M >= ROUTE_M; >= 64, or 16 with the dots swapped), A rows
    ``pair // A_ROW_DIV``, expert BLOCK_EXPERT[b]; out row = pair id. TMA: the weight tiles by TMA
    (``_expert_b``; the A rows are gathered pairs, loaded by pointers either way). A tile's columns
    past N then read the next expert's rows (zeros past the last): their outputs are masked."""
    pdl_start(PDL, pdl_early)
    b = tl.program_id(0)
    e = tl.load(BLOCK_EXPERT + b).to(tl.int64)
    if e >= num_experts:
        return
    pairs, valid, rows = _block_pairs(SORTED, b, num_pairs, A_ROW_DIV, ROUTE_M, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    cols = rn.to(tl.int64)
    w_e, w_row = _expert_b(W, e, tl.program_id(1), stride_we, stride_wn, BLOCK_N, TMA)
    ws_e = WS + e * stride_wse
    kb = tl.cdiv(K, 128)
    if SWAP and SILU_MUL:  # gate and up in one K loop, one A tile (two [BLOCK_N, 16] accumulators)
        acc, up = _k_blocks(A, AS, w_e, ws_e, rows, valid, cols, n_ok, K, 0, kb, stride_am, stride_asm, stride_wn,
                            stride_wsn, N, BLOCK_M, BLOCK_N, True, DOT, True, w_row, TMA)
    else:
        acc, _ = _k_blocks(A, AS, w_e, ws_e, rows, valid, cols, n_ok, K, 0, kb, stride_am, stride_asm, stride_wn,
                           stride_wsn, 0, BLOCK_M, BLOCK_N, False, DOT, SWAP, w_row, TMA)
        up = acc
        if SILU_MUL:  # the up rows in a second pass (one pass with two [128, 128] accumulators: register pressure)
            up, _ = _k_blocks(A, AS, w_e, ws_e, rows, valid, cols + N, n_ok, K, 0, kb, stride_am, stride_asm,
                              stride_wn, stride_wsn, 0, BLOCK_M, BLOCK_N, False, DOT, SWAP, w_row + N, TMA)
    _store_pairs(C, pairs, valid, rn, n_ok, acc, up, stride_cm, SILU_MUL)


def _weight_operand(w: torch.Tensor, block_n: int, a: torch.Tensor, tma: bool) -> tuple[object, bool]:
    """The kernels' W for experts' weights ``w [E, rows, K]``: with ``tma``, where the weights allow
    it (SM90 or the interpreter, contiguous, 16-byte aligned: ``gemm._tma_ready``), a descriptor
    over ``[E * rows, K]`` in [block_n, 128] blocks; else the tensor (the same tiles by pointers,
    the same bits). -> (W, whether it is a descriptor)."""
    flat = w.view(-1, w.shape[-1]) if w.is_contiguous() else None
    if not (tma and flat is not None and _tma_ready(a, flat)):
        return w, False
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(flat, [block_n, BLOCK]), True


# up to this many tokens the experts run per pair. Both paths swapped, on an H200
# (fp8_kernel_bench.py --moe, benchmarks section 33): per pair 14.8 vs sorted 18.5 us at 1 token,
# 62.7 vs 68.9 at 8, 98.9 vs 101.0 at 16, 167 vs 152 at 32; in the engine (35B-A3B FP8) 8 instead
# of 2 took decode B=8 from 5.33 to 5.13 ms.
PAIR_TOKENS = 8
PAIR_BLOCK_M = 64  # unswapped, the pair in row 0 of a 64-row tile: the in-block dots stay on fp8 wgmma (fp8.py)
# swapped dots (fp8._k_blocks' SWAP): on an H200 (fp8_kernel_bench.py --swap, benchmarks section 32)
# 19.4 vs 23.9 us at 1 token and 27.8 vs 34.2 at 2 against 64-row tiles of 32 / 64 columns, same bits.
# The weight tiles by TMA (section 41, fp8_kernel_bench.py --moe): 60.3 vs 61.1 us at 8 tokens, 14.7
# vs 14.1 at 1, same bits (the sorted path at 16 tokens, which uses these tiles: 99.7 vs 101.3)
PAIR_UP = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 4, "SWAP": True, "TMA": True}
PAIR_DOWN = {"BLOCK_N": 128, "num_warps": 4, "num_stages": 4, "SWAP": True, "TMA": True}


@triton.jit
def _fp8_pair_up_kernel(XQ, XS, W, WS, H, IDS, num_pairs, N, K, num_experts, stride_x, stride_xs, stride_we, stride_wn,
                        stride_wse, stride_wsn, stride_h, TOP_K: tl.constexpr, SLOTS: tl.constexpr,
                        E_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr,
                        SWAP: tl.constexpr, TMA: tl.constexpr, PDL: tl.constexpr, pdl_early):
    """Program (pair p, column tile): token p // SLOTS's quantized row in row 0 of the tile, its
    expert's gate and up rows in one K loop (two accumulators, one A tile), moe.py's epilogue:
    h[p] = silu(gate) * up. TMA: the weight tiles by TMA (``_expert_b``)."""
    pdl_start(PDL, pdl_early)
    p = tl.program_id(0)
    e = _expert_of(IDS, p, num_pairs, TOP_K, SLOTS, num_experts, E_BLOCK).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    row0 = tl.arange(0, BLOCK_M) == 0
    rows = tl.where(row0, p // SLOTS, 0).to(tl.int64)
    w_e, w_row = _expert_b(W, e, tl.program_id(1), stride_we, stride_wn, BLOCK_N, TMA)
    acc, up = _k_blocks(XQ, XS, w_e, WS + e * stride_wse, rows, row0, rn.to(tl.int64), n_ok, K, 0, tl.cdiv(K, 128),
                        stride_x, stride_xs, stride_wn, stride_wsn, N, BLOCK_M, BLOCK_N, True, DOT, SWAP, w_row, TMA)
    out = _epilogue(acc, up, H.dtype.element_ty, True)
    h_ptr = H + p.to(tl.int64) * stride_h + tl.arange(0, BLOCK_M)[:, None] * 0 + rn[None, :]
    tl.store(h_ptr, out, mask=row0[:, None] & n_ok[None, :])


@triton.jit
def _fp8_pair_down_kernel(HQ, HS, W, WS, Y, WTS, IDS, SHARED_LOGIT, OUT, LOCKS, N, K, num_experts, stride_h,
                          stride_hs, stride_we, stride_wn, stride_wse, stride_wsn, stride_sl, TOP_K: tl.constexpr,
                          SLOTS: tl.constexpr, E_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          DOT: tl.constexpr, SWAP: tl.constexpr, TMA: tl.constexpr, PDL: tl.constexpr, pdl_early):
    """Program (pair p, column tile): h[p]'s quantized row in row 0 of the tile, the down projection
    (TMA: the weight tiles by TMA, ``_expert_b``),
    stored rounded to Y; the last of a token's SLOTS programs to arrive (a per-(token, tile)
    counter, left at zero) combines the token's rows in slot order (moe.py's ``_combine``). The
    counter elects who adds; it orders nothing arithmetic."""
    pdl_start(PDL, pdl_early)
    p = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    t = p // SLOTS
    rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    dt = OUT.dtype.element_ty
    e = _expert_of(IDS, p, p + 1, TOP_K, SLOTS, num_experts, E_BLOCK).to(tl.int64)
    row0 = tl.arange(0, BLOCK_M) == 0
    w_e, w_row = _expert_b(W, e, tile, stride_we, stride_wn, BLOCK_N, TMA)
    acc, _ = _k_blocks(HQ, HS, w_e, WS + e * stride_wse, tl.where(row0, p, 0), row0, rn.to(tl.int64), n_ok, K, 0,
                       tl.cdiv(K, 128), stride_h, stride_hs, stride_wn, stride_wsn, 0, BLOCK_M, BLOCK_N, False, DOT,
                       SWAP, w_row, TMA)
    y_ptr = Y + p * N + tl.arange(0, BLOCK_M)[:, None] * 0 + rn[None, :]
    tl.store(y_ptr, acc.to(dt), mask=row0[:, None] & n_ok[None, :])
    tl.debug_barrier()  # every thread's row is written before the arrival is counted
    lock = LOCKS + t * tl.num_programs(1) + tile
    if tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu") == SLOTS - 1:
        total = _combine(Y, WTS, SHARED_LOGIT, t, rn, n_ok, N, stride_sl, dt, TOP_K, SLOTS, ".cg")  # from L2
        tl.store(OUT + t * N + rn, total.to(dt), mask=n_ok)
        tl.atomic_xchg(lock, 0)  # left at zero for the next call (and graph replays)


def _pair_tile(cfg: dict) -> dict:
    """A per-pair kernel's launch shape with its row count: 16 rows swapped, 64 not (a tile given
    without SWAP is unswapped); refused off the fp8 wgmma (``fp8.check_wgmma_tile``)."""
    tile = {"SWAP": False, "TMA": False, **cfg}
    tile["BLOCK_M"] = SWAP_BLOCK_M if tile["SWAP"] else PAIR_BLOCK_M
    check_wgmma_tile(tile["BLOCK_M"], tile["BLOCK_N"], tile["SWAP"])
    return tile


def _fp8_moe_per_pair(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
                      w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                      shared_logits: torch.Tensor | None, up: dict = PAIR_UP, down: dict = PAIR_DOWN,
                      x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Four launches for a few tokens, no routing sort: x quantized, the gate/up GEMM a program per
    (pair, column tile), h quantized, the down GEMM a program per (pair, column tile), the last of
    a token's pairs combining them. Every number is the sorted path's (the same quantized rows,
    the same row arithmetic, the same roundings): tests check the two bitwise."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    assert inter % BLOCK == 0, "gate and up must not share a scale block"
    slots = top_k + (1 if shared_logits is not None else 0)
    num_pairs = num_tokens * slots
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    e_block = triton.next_power_of_2(num_experts + 1)
    dot = dot_mode(torch.float8_e4m3fn)
    up, down = _pair_tile(up), _pair_tile(down)
    xq, xs = quantize_act(x) if x_fp8 is None else x_fp8
    h = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    w13_op, up["TMA"] = _weight_operand(w13, up["BLOCK_N"], xq, up["TMA"])
    _fp8_pair_up_kernel[(num_pairs, triton.cdiv(inter, up["BLOCK_N"]))](
        xq, xs, w13_op, w13_scale, h, ids, num_pairs, inter, hidden, num_experts, xq.stride(0), xs.stride(0),
        w13.stride(0), w13.stride(1), w13_scale.stride(0), w13_scale.stride(1), h.stride(0), TOP_K=top_k, SLOTS=slots,
        E_BLOCK=e_block, DOT=dot, **up, **pdl())
    hq, hs = quantize_act(h)
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    y = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    assert num_tokens * triton.cdiv(hidden, down["BLOCK_N"]) <= MAX_LOCKS  # a counter per (token, column tile)
    logits = shared_logits if shared_logits is not None else topk_weights
    w2_op, down["TMA"] = _weight_operand(w2, down["BLOCK_N"], hq, down["TMA"])
    _fp8_pair_down_kernel[(num_pairs, triton.cdiv(hidden, down["BLOCK_N"]))](
        hq, hs, w2_op, w2_scale, y, topk_weights.contiguous(), ids, logits, out, tile_locks(x.device), hidden, inter,
        num_experts, hq.stride(0), hs.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1),
        logits.stride(0), TOP_K=top_k, SLOTS=slots, E_BLOCK=e_block, DOT=dot, **down, **pdl())
    return out


# the sorted path swaps its dots up to routing blocks of SWAP_BLOCK_M rows (decode: 16), as per
# pair: an expert's 16 rows against 64 (gate/up) or 128 (down) weight rows a tile, gate and up in
# one K loop, instead of 64-row tiles that are three quarters padding. On an H200 (section 33):
# 101 vs 121 us at 16 tokens, 189 vs 224 at 64, the same bits; 35B-A3B FP8 decode B=64 15.14 ->
# 13.77 ms, B=8 5.93 -> 5.33 (before PAIR_TOKENS = 8): the per-pair kernels' tiles (PAIR_UP, PAIR_DOWN).
# Prefill: routing blocks of at most ROUTE_BLOCK_MAX rows, on 64 x 128 tiles (4 warps, 4 stages)
# whose weight tiles come by TMA. At about 140 pairs an expert, 128-row blocks pad about half the
# experts to 256 rows. On an H200 (fp8_kernel_bench.py --moe-prefill, benchmarks section 40), the
# routed experts of 35B-A3B took 765 vs 933 us at 4,096 tokens and 2,415 vs 2,696 at 16,384,
# against 128-row blocks on 128 x 128 tiles, 8 warps (the same bits: checked there and in the tests).
ROUTE_BLOCK_MAX = 64
PREFILL_TILE = {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4, "SWAP": False, "TMA": True}


def grouped_config(route_m: int, silu_mul: bool = True) -> dict:
    """Launch shape from the routing block (speed only: the K order is fixed by K)."""
    if route_m <= SWAP_BLOCK_M:
        return _pair_tile(PAIR_UP if silu_mul else PAIR_DOWN)
    if route_m == PREFILL_TILE["BLOCK_M"]:  # 33 to 64 pairs an expert, and prefill (ROUTE_BLOCK_MAX)
        return dict(PREFILL_TILE)
    block_m = max(64, route_m)  # 32-row blocks; and 128 (tests, benchmarks: ROUTE_BLOCK_MAX raised)
    return {"BLOCK_M": block_m, "BLOCK_N": 64 if route_m <= 32 else 128, "num_warps": 8 if block_m == 128 else 4,
            "num_stages": 3, "SWAP": False}


def fp8_grouped_gemm(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, routing: Routing,
                     a_row_div: int, silu_mul: bool = False, out_dtype: torch.dtype = torch.bfloat16,
                     config: dict | None = None) -> torch.Tensor:
    """For every pair p: ``out[p] = A[p // a_row_div] @ w[expert(p)].T`` with A = (xq, xs) quantized
    rows (``fp8.quantize_act``), w ``[E, N, K]`` float8_e4m3fn and w_scale ``[E, ceil(N/128),
    ceil(K/128)]`` float32; with ``silu_mul`` w is ``[E, 2N, K]`` and ``out[p] = silu(gate) * up``
    -> ``[num_pairs, N]`` out_dtype. ``config`` overrides the launch shape (tests, benchmarks)."""
    num_experts, n, k = w.shape
    n = n // 2 if silu_mul else n
    assert w.dtype == torch.float8_e4m3fn and w.stride(2) == 1 and xq.shape[1] == k and xq.stride(1) == 1
    assert tuple(w_scale.shape) == (num_experts, triton.cdiv(w.shape[1], BLOCK), triton.cdiv(k, BLOCK))
    assert w_scale.dtype == torch.float32 and w_scale.stride(2) == 1 and xs.stride(1) == 1
    assert not silu_mul or n % BLOCK == 0, "gate and up must not share a scale block"
    out = torch.empty((routing.num_pairs, n), dtype=out_dtype, device=xq.device)
    if routing.num_pairs == 0:
        return out
    cfg = {**grouped_config(routing.block_m, silu_mul), **(config or {})}
    assert cfg["BLOCK_M"] >= routing.block_m, f"BLOCK_M {cfg['BLOCK_M']} < the routing block {routing.block_m}"
    check_wgmma_tile(cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["SWAP"])
    grid = (routing.block_expert.shape[0], triton.cdiv(n, cfg["BLOCK_N"]))
    w_op, tma = _weight_operand(w, cfg["BLOCK_N"], xq, cfg.get("TMA", False))
    _fp8_grouped_kernel[grid](xq, xs, w_op, w_scale, out, routing.sorted_pairs, routing.block_expert,
                              routing.num_pairs, n, k, num_experts, xq.stride(0), xs.stride(0), w.stride(0),
                              w.stride(1), w_scale.stride(0), w_scale.stride(1), out.stride(0), A_ROW_DIV=a_row_div,
                              SILU_MUL=silu_mul, ROUTE_M=routing.block_m, BLOCK_M=cfg["BLOCK_M"],
                              BLOCK_N=cfg["BLOCK_N"], DOT=dot_mode(torch.float8_e4m3fn), SWAP=cfg["SWAP"], TMA=tma,
                              num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl())
    return out


def fp8_fused_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
                  w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                  shared_logits: torch.Tensor | None = None, config: dict | None = None,
                  per_pair: bool | None = None, x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> torch.Tensor:
    """Σ_j w_j · SwiGLU-expert_{id_j}(x) per token, combined in fp32 in slot order (moe.fused_moe's
    contract, block-FP8 weights); with ``shared_logits`` the last expert is the shared expert,
    gated by sigmoid(logit). Up to PAIR_TOKENS tokens per pair (4 launches), more sorted by expert
    (6 launches): the same bits either way. ``per_pair`` forces a path and ``config`` overrides
    the sorted path's launch shapes (tests, benchmarks). ``x_fp8``: ``quantize_act(x)``, when a
    norm already wrote it."""
    num_tokens = x.shape[0]
    if num_tokens == 0:
        return torch.empty_like(x)
    if per_pair if per_pair is not None else (num_tokens <= PAIR_TOKENS and config is None):
        return _fp8_moe_per_pair(x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale, shared_logits, x_fp8=x_fp8)
    routing = align(topk_ids, w13.shape[0], shared=shared_logits is not None, max_block_m=ROUTE_BLOCK_MAX)
    xq, xs = quantize_act(x) if x_fp8 is None else x_fp8
    h = fp8_grouped_gemm(xq, xs, w13, w13_scale, routing, routing.slots, silu_mul=True, out_dtype=x.dtype,
                         config=config)
    y = fp8_grouped_gemm(*quantize_act(h), w2, w2_scale, routing, 1, out_dtype=x.dtype, config=config)
    return moe_combine(y, topk_weights, shared_logits)
