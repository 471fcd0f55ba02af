"""Block-FP8 W8A8 linear layers (the Qwen3.5-*-FP8 checkpoints' format), batch-invariant.

Format (issue 25). A quantized linear stores ``weight`` float8_e4m3fn ``[N, K]`` row-major and
``weight_scale_inv`` float32 ``[ceil(N/128), ceil(K/128)]``: weight block (nb, kb) dequantizes as
``wq[nb*128:(nb+1)*128, kb*128:(kb+1)*128].float() * ws[nb, kb]`` (ragged edge blocks included).
Activations are quantized at run time, per token and group of 128 columns (``quantize_act``).

Arithmetic (every operation below is in float32 and rounds to nearest even):

- Activation group g of row m (columns past K count as 0): ``amax = max |x|`` (exact in any
  order), ``xs[m, g] = max(amax, 1e-10) / 448`` and ``xq = e4m3(clamp(x / xs, -448, 448))``, both
  divisions correctly rounded (``div_rn``: Triton's plain ``/`` is the approximate
  ``div.full.f32`` on the GPU, which no CPU reference reproduces; vLLM's per-token-group
  quantizer uses ``/``, so its xq/xs can differ from ours in the last place). The rounding to e4m3
  (ties to even, sign kept, subnormals down to 2**-9) is done in float32 arithmetic
  (``e4m3.round_e4m3``), so the cast to float8 that follows is exact: Triton's CPU interpreter casts
  float32 to float8 wrongly (no ties-to-even, no carry into the exponent: -124 becomes -64);
  with the rounding done first the interpreter runs the GPU's code and gets the GPU's bits.
- GEMM, element (m, n): for each K block kb of 128 in ascending order,
  ``p = dot(xq[m, kb], wq[n, kb])`` (a 128-deep dot from zero: one tensor-core instruction
  sequence per block, its products exact), ``t = p * xs[m, kb]``,
  ``acc = fma(t, ws[n // 128, kb], acc)``, starting from ``acc = 0``; y = ``acc`` rounded to
  ``out_dtype``. This is the order of vLLM's and SGLang's Triton ``w8a8_block_fp8_matmul``
  (``acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]``: compiled for sm_90 by Triton 3.9 with
  its default fp fusion, the PTX holds one mul.f32 and one fma.rn.f32 per element, i.e. this fma;
  without fusion, two muls and an add). Written out here so it cannot depend on the fusion
  setting. DeepGEMM multiplies the scales first (``acc += (xs * ws) * p``), so it can differ from
  both in the last place. With SPLIT_K > 1 the K blocks are cut into SPLIT_K consecutive ranges
  of ceil(KB / SPLIT_K) blocks (``split_k_for`` makes them equal); each range is the loop above
  from zero, and the range sums are added in range order
  (``((s0 + s1) + s2) + ...``), in one program (INLINE) or by the last program of the tile to
  arrive (a per-tile counter elects it; it orders nothing arithmetic), the same bits either way.

Invariance: quantization reads one row's group only. The GEMM's K order (BLOCK_K = 128, the
split count and ranges) is fixed by (N, K) alone (``split_k_for``), never by M. The M bucket of
``fp8_config`` picks only BLOCK_M, BLOCK_N, warps, stages, SWAP, INLINE and TMA: none of these
changes a row's operations or their order. Every
batch size runs its in-block dots on the same instruction, Hopper's fp8 wgmma: BLOCK_M is 64 or
128, or (up to SWAP_M_MAX rows) the dot is swapped, ``w @ a^T`` with 64 weight rows as the wgmma's
M side and 16 activation rows as its N side (compiled for sm_90 with Triton 3.9, an unswapped
BLOCK_M of 16 or 32 upcasts the tiles to fp16 and sums them with mma.sync m16n8k16: a different
in-block sum). A swapped dot multiplies the same pairs and sums them alike: on an H200 every
swapped output of ``fp8_kernel_bench.py --swap`` had the unswapped bits (benchmarks section 32),
and the GPU tests compare rows alone (swapped) with rows in 1024-row batches. tests/kernels/test_fp8.py
checks all of this bitwise under Triton's interpreter with a dot that sums each element in K
order (``ordered_dot``): that proves the kernel's own arithmetic. Whether the GPU's fp8 wgmma
gives an element the same bits at every position in a tile and for every tile width (BLOCK_N
32..128, 4 or 8 warps) is the hardware's side, checked by the GPU-only tests in test_fp8.py (rows
bitwise over M = 1..1024 and row permutations at the model shapes, dense and MoE): they pass on
an H200 (docs/benchmarks.md sections 16, 20, 21).

Tuning: the split counts follow the bf16 GEMM's reasoning (decode GEMVs need about
TARGET_PROGRAMS programs: split-K fixed by (N, K)); the decode tiles come from sweeps on an H200
(``benchmarks/fp8_kernel_bench.py``; docs/benchmarks.md).

API for the backends (all tensors on one CUDA device, or the CPU under TRITON_INTERPRET=1):

- ``quantize_act(x [M, K] bf16/fp16/fp32, row stride any, unit column stride)``
  -> ``(xq float8_e4m3fn [M, K] contiguous, xs float32 [M, ceil(K/128)] contiguous)``.
- ``fp8_gemm(xq, xs, wq, ws, out_dtype=torch.bfloat16, out=None, config=None)`` -> ``y [M, N]``:
  xq ``[M, K]`` float8_e4m3fn, xs ``[M, ceil(K/128)]`` float32 (both unit column stride), wq
  ``[N, K]`` float8_e4m3fn row-major, ws ``[ceil(N/128), ceil(K/128)]`` float32 (unit column
  stride): the checkpoint's ``weight`` and ``weight_scale_inv`` as stored.
- ``fp8_linear(x [..., K], wq, ws, out=None, config=None)`` -> ``[..., N]`` in x's dtype:
  ``fp8_gemm(*quantize_act(x), wq, ws, x.dtype)``.
- ``fp8_config(m, n, k)``: the tile table (``config`` overrides it, for benchmarks and tests;
  a different SPLIT_K is a different K order).
- Routed experts: ``fp8_moe.fp8_fused_moe`` (the same per-block arithmetic, ``_k_blocks``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bi_core.kernels.common import dot_mode, mma, pdl, pdl_start
from bi_core.kernels.e4m3 import GROUP, quant_group
from bi_core.kernels.gemm import MAX_LOCKS, TMA_MIN_M, TMA_MIN_N, _tile, _tma_ready, tile_locks

BLOCK = GROUP  # activation group width = weight block side = the GEMM's BLOCK_K (kernels/e4m3.py)
TARGET_PROGRAMS = 264  # about two programs per SM of an H100/H200 (132 SMs), as in gemm.py
DECODE_BLOCK_N = 32  # the tile width split counts are planned against (a decode GEMV's)
MIN_SPLIT_BLOCKS = 4  # no split range shorter than 4 K blocks (512 bytes of a weight row, gemm.py's minimum)
# (Removed in the thirty-first session, after losing everywhere: quantizing the activation inside
# the GEMM's launch, each column tile again. It won at M = 1 against 64-row quantize tiles (section
# 20); against one-row quantize tiles and swapped dots it lost at every M (section 32), and turning
# it off took 35B-A3B FP8 decode at B=1 from 2.920 to 2.872 ms (section 33).)
SMALL_M_MAX = 64  # rows up to which the decode tiles are used
# up to SWAP_M_MAX rows each block's dot is swapped (``_k_blocks``' SWAP): 16-row activation tiles,
# 64 weight rows as the wgmma's M side. On an H200 (fp8_kernel_bench.py --swap, benchmarks section
# 32) the GEMM alone at M = 1..16 is 1.2-1.7x faster than 64 x 32 tiles, with the same bits.
SWAP_M_MAX = 16
SWAP_BLOCK_M = 16
# rows per quantize_act program: any value gives the same bits. Every row of a tile is divided
# (padding rows too), so few rows a program and enough programs: about QUANT_ROW_PROGRAMS row
# tiles per group column, at most QUANT_BLOCK_M rows (M <= 16: one row a program; 64: 4; 1024: 64).
# At M = 8, 16-row tiles took 2.4 us a call in the engine's profile; with this rule 35B-A3B FP8 decode
# went 2.902 -> 2.857 ms at B=1, 5.176 -> 5.025 at B=8, 13.771 -> 13.423 at B=64 (benchmarks section 33).
QUANT_BLOCK_M = 64
QUANT_ROW_PROGRAMS = 16
MID_M_MAX = 256  # rows up to which 64-row tiles are used
# From TMA_MIN_M rows (and TMA_MIN_N columns: gemm.py's bounds) the GEMM runs _fp8_gemm_tma_kernel
# with this tile (BLOCK_M, BLOCK_N, warps, stages), a program a tile. Swept on an H200 (benchmarks
# section 39; fp8_kernel_bench.py --prefill): at 12352 x 2048 and 4096 x 2048, M = 4096 and 16384, it
# was the fastest TMA tile at 3 of 4 points (272-279 / 1207 / 108 / 412 us), against 128 x 256 8w
# (gemm.py's bf16 tile: 506 / 2002 us) and 128 x 128 8w (331 / 1298 / 136 / 522 us); persistent
# programs lost 2-60% with every tile, and two blocks' dots in flight lost 10-100%.
TMA_TILE = (64, 128, 4, 3)
_BK = tl.constexpr(BLOCK)  # the kernels' copies (a jitted function reads only constexpr globals)


@triton.jit(do_not_specialize=["M"])
def _quant_kernel(X, XQ, XS, M, K, stride_xm, stride_qm, stride_sm, BLOCK_M: tl.constexpr, PDL: tl.constexpr, pdl_early):
    pdl_start(PDL, pdl_early)
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1)
    rk = g * _BK + tl.arange(0, _BK)
    m_ok = rm < M
    mask = m_ok[:, None] & (rk < K)[None, :]
    rows = rm.to(tl.int64)[:, None]
    x = tl.load(X + rows * stride_xm + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    # rows past M (never stored) as ones, not zeros: an all-zero row divides 0 by a tiny scale,
    # which div_rn takes through its slow path (measured: several times slower at M = 1..8)
    x = tl.where(m_ok[:, None], x, 1.0)
    q, scale = quant_group(x)
    tl.store(XQ + rows * stride_qm + rk[None, :], q.to(XQ.dtype.element_ty), mask=mask)
    tl.store(XS + rm.to(tl.int64) * stride_sm + g, scale, mask=m_ok)


@triton.jit
def _a_block(A, AS, rows, row_ok, K, kb, stride_am, stride_asm):
    """K block ``kb`` (< cdiv(K, 128)) of the A tile (rows ``rows`` where ``row_ok``) and its row scales."""
    rk = tl.arange(0, _BK)
    k_ok = rk + kb * _BK < K
    a = tl.load(A + rows[:, None] * stride_am + (rk + kb * _BK)[None, :], mask=row_ok[:, None] & k_ok[None, :],
                other=0.0)
    a_s = tl.load(AS + rows * stride_asm + kb, mask=row_ok, other=0.0)
    return a, a_s


@triton.jit
def _b_block(B, BS, cols, col_ok, K, kb, stride_bn, stride_bsn, B_ROW, TMA: tl.constexpr):
    """K block ``kb`` (< cdiv(K, 128)) of the B tile (rows ``cols`` of [N, K]) as [128, BLOCK_N],
    and its column scales. TMA: B is a tensor descriptor (blocks [BLOCK_N, 128]) and the tile is its
    rows ``B_ROW ..`` (B_ROW the descriptor's row of cols[0]); a block past K reads zeros, as the
    masked load does, and rows past col_ok read what is there (their outputs are masked)."""
    b_s = tl.load(BS + (cols // _BK) * stride_bsn + kb, mask=col_ok, other=0.0)
    if TMA:  # (if/else, not an early return: the compiler would still build the pointer code for a descriptor)
        b = B.load([B_ROW, kb * _BK]).T
    else:
        rk = tl.arange(0, _BK)
        k_ok = rk + kb * _BK < K
        b = tl.load(B + cols[None, :] * stride_bn + (rk + kb * _BK)[:, None], mask=col_ok[None, :] & k_ok[:, None],
                    other=0.0)
    return b, b_s


@triton.jit
def _block_step(a, a_s, b, b_s, acc, zero, DOT: tl.constexpr):
    """One K block, unswapped: the 128-deep dot of ``a [BLOCK_M, 128]`` and ``b [128, BLOCK_N]``
    from zero, times the row scales, fma'd with the column scales into ``acc``."""
    return tl.fma(mma(a, b, zero, DOT) * a_s[:, None], b_s[None, :], acc)


@triton.jit
def _k_blocks(A, AS, B, BS, rows, row_ok, cols, col_ok, K, kb_lo, kb_hi, stride_am, stride_asm, stride_bn,
              stride_bsn, UP, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TWO: tl.constexpr,
              DOT: tl.constexpr, SWAP: tl.constexpr, B_ROW, TMA: tl.constexpr):
    """K blocks [kb_lo, kb_hi) of a tile (B rows ``cols``: int64 indices) in ascending order, from
    zero: per block a 128-deep dot from zero, times the row scales, fma'd with the column scales
    into the fp32 accumulator. The one copy of the GEMM arithmetic: the dense, grouped and per-pair
    kernels all run it. A is quantized (A, AS: ``quantize_act``'s xq, xs), tile rows ``rows``
    (int64 [BLOCK_M]) where ``row_ok``.

    - TWO: a second accumulator over B rows ``cols + UP`` (an expert's up projection beside its
      gate), sharing each block's A tile: (acc, acc_up), each the same sums as its own call.

    - TMA: the B tiles by TMA (``_b_block``: B a descriptor, rows ``B_ROW ..``, the up rows
      ``B_ROW + UP ..``); the same values in the same operations, so the same bits.

    - SWAP: each block's dot with the operands' roles swapped, ``w @ a^T`` ([BLOCK_N, BLOCK_M],
      the weight rows as the tensor core's M side), the accumulators transposed back at the end:
      the same products and the same scale arithmetic per element, so a small-M tile can be 16
      rows while the dot stays a wgmma (its M side is BLOCK_N >= 64). Whether Hopper's fp8 wgmma
      sums an element alike with its operands swapped is the hardware's side, checked bitwise on
      the GPU (tests/kernels/test_fp8.py, GPU only).

    Tried and measured slower on an H200 (benchmarks section 20): two blocks' dots issued before
    either is scaled (same bits, 10-40% slower per GEMV)."""
    if SWAP:
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        up_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        zero_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for kb in range(kb_lo, kb_hi):
            a, a_s = _a_block(A, AS, rows, row_ok, K, kb, stride_am, stride_asm)
            a_t = tl.trans(a)
            b, b_s = _b_block(B, BS, cols, col_ok, K, kb, stride_bn, stride_bsn, B_ROW, TMA)
            part = mma(tl.trans(b), a_t, zero_t, DOT)
            acc_t = tl.fma(part * a_s[None, :], b_s[:, None], acc_t)
            if TWO:
                b_up, s_up = _b_block(B, BS, cols + UP, col_ok, K, kb, stride_bn, stride_bsn, B_ROW + UP, TMA)
                part_up = mma(tl.trans(b_up), a_t, zero_t, DOT)
                up_t = tl.fma(part_up * a_s[None, :], s_up[:, None], up_t)
        return tl.trans(acc_t), tl.trans(up_t)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb_lo, kb_hi):
        a, a_s = _a_block(A, AS, rows, row_ok, K, kb, stride_am, stride_asm)
        b, b_s = _b_block(B, BS, cols, col_ok, K, kb, stride_bn, stride_bsn, B_ROW, TMA)
        acc = _block_step(a, a_s, b, b_s, acc, zero, DOT)
        if TWO:
            b_up, s_up = _b_block(B, BS, cols + UP, col_ok, K, kb, stride_bn, stride_bsn, B_ROW + UP, TMA)
            acc_up = _block_step(a, a_s, b_up, s_up, acc_up, zero, DOT)
    return acc, acc_up


@triton.jit
def _tma_block(a_desc, b_desc, AS, BS, a_rows, b_rows, row_ok, col_ok, om, on, kb):
    """K block ``kb`` of a TMA tile: (a [BLOCK_M, 128], its row scales, b [128, BLOCK_N], its column scales)."""
    a = a_desc.load([om, kb * _BK])
    b = b_desc.load([on, kb * _BK]).T
    a_s = tl.load(AS + a_rows + kb, mask=row_ok, other=0.0)
    b_s = tl.load(BS + b_rows + kb, mask=col_ok, other=0.0)
    return a, a_s, b, b_s


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_tma_kernel(a_desc, AS, b_desc, BS, C, M, N, K, KB_PER_SPLIT, stride_asm, stride_bsn, stride_cm,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr,
                         DOT: tl.constexpr, PDL: tl.constexpr, pdl_early):
    """``_fp8_gemm_kernel``'s INLINE form (one program adds its tile's ranges in range order) for
    prefill-sized M on SM90, as gemm.py's ``_gemm_tma_kernel``, a program a tile: both FP8 operands
    come by TMA (a block past K or past the rows reads zeros, as the masked loads do), the scales
    by plain loads. Per block the same ``_block_step`` in the same order: every bit is the pointer
    kernel's. (Persistent programs looping over the tiles lost at every tile: section 39.)"""
    pdl_start(PDL, pdl_early)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    kb_total = tl.cdiv(K, _BK)
    zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    pid_m, pid_n = _tile(tl.program_id(0), num_m, num_n, GROUP_M)
    om = pid_m * BLOCK_M
    on = pid_n * BLOCK_N
    rm = om + tl.arange(0, BLOCK_M)
    rn = on + tl.arange(0, BLOCK_N)
    row_ok = rm < M
    col_ok = rn < N
    a_rows = rm.to(tl.int64) * stride_asm
    b_rows = (rn // _BK).to(tl.int64) * stride_bsn
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(0, SPLIT_K):
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        lo = s * KB_PER_SPLIT
        hi = tl.minimum(kb_total, lo + KB_PER_SPLIT)
        for kb in range(lo, hi):
            a, a_s, b, b_s = _tma_block(a_desc, b_desc, AS, BS, a_rows, b_rows, row_ok, col_ok, om, on, kb)
            acc = _block_step(a, a_s, b, b_s, acc, zero, DOT)
        total = tl.where(s == 0, acc, total + acc)  # range 0 as is, as in _fp8_gemm_kernel
    tl.store(C + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :], total.to(C.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["M"])  # M changes every step: no compiled variant per M % 16
def _fp8_gemm_kernel(A, AS, B, BS, C, WS, LOCKS, M, N, K, KB_PER_SPLIT, stride_am, stride_asm, stride_bn,
                     stride_bsn, stride_cm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
                     INLINE: tl.constexpr, GROUP_M: tl.constexpr, DOT: tl.constexpr, SWAP: tl.constexpr,
                     PDL: tl.constexpr, pdl_early):
    pdl_start(PDL, pdl_early)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kb_total = tl.cdiv(K, _BK)
    cols = rn.to(tl.int64)
    rows = rm.to(tl.int64)
    row_ok = rm < M
    col_ok = rn < N
    c_mask = (rm[:, None] < M) & (rn[None, :] < N)
    c_ptr = C + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
    dt = C.dtype.element_ty
    if INLINE:  # one program does every range and adds them in range order: no workspace
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in range(0, SPLIT_K):
            lo = s * KB_PER_SPLIT
            acc, _ = _k_blocks(A, AS, B, BS, rows, row_ok, cols, col_ok, K, lo,
                               tl.minimum(kb_total, lo + KB_PER_SPLIT), stride_am, stride_asm, stride_bn, stride_bsn,
                               0, BLOCK_M, BLOCK_N, False, DOT, SWAP, 0, False)
            total = tl.where(s == 0, acc, total + acc)  # range 0 as is (a -0.0 stays -0.0, as in the fix-up)
        tl.store(c_ptr, total.to(dt), mask=c_mask)
    else:  # a constexpr branch: without splits the workspace code is never compiled (WS, LOCKS may be C)
        lo = split * KB_PER_SPLIT
        acc, _ = _k_blocks(A, AS, B, BS, rows, row_ok, cols, col_ok, K, lo, tl.minimum(kb_total, lo + KB_PER_SPLIT),
                           stride_am, stride_asm, stride_bn, stride_bsn, 0, BLOCK_M, BLOCK_N, False, DOT, SWAP, 0,
                           False)
        if SPLIT_K == 1:
            tl.store(c_ptr, acc.to(dt), mask=c_mask)
        else:
            tile_elems = rm.to(tl.int64)[:, None] * N + rn[None, :]
            tl.store(WS + split * M * N + tile_elems, acc, mask=c_mask)
            tl.debug_barrier()  # every thread's partial is written before the arrival is counted
            arrived = tl.atomic_add(LOCKS + pid, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:  # the last program of this tile adds the ranges in range order
                total = tl.load(WS + tile_elems, mask=c_mask, other=0.0, cache_modifier=".cg")
                for s in range(1, SPLIT_K):
                    total += tl.load(WS + s * M * N + tile_elems, mask=c_mask, other=0.0, cache_modifier=".cg")
                tl.store(c_ptr, total.to(dt), mask=c_mask)
                tl.atomic_xchg(LOCKS + pid, 0)  # left at zero for the next call (and graph replays)


def split_k_for(n: int, k: int) -> int:
    """The K order's split count: a function of (N, K) alone. Enough ranges that a one-row GEMM
    fills about TARGET_PROGRAMS programs of DECODE_BLOCK_N columns, each range the same whole
    number of K blocks and at least MIN_SPLIT_BLOCKS long."""
    kb, tiles, split = triton.cdiv(k, BLOCK), triton.cdiv(n, DECODE_BLOCK_N), 1
    while tiles * split < TARGET_PROGRAMS and kb // (2 * split) >= MIN_SPLIT_BLOCKS and kb % (2 * split) == 0:
        split *= 2
    return split


def fp8_config(m: int, n: int, k: int) -> dict:
    """SPLIT_K (with BLOCK_K = 128) is the K order, from (N, K) alone. The M bucket (<= 16, <= 64,
    <= 256, more rows) picks only what cannot change a row's arithmetic: SWAP with 16-row tiles
    and BLOCK_N 64, else BLOCK_M 64 or 128 (the in-block dots stay on wgmma at every M: a swapped
    dot's M side is BLOCK_N), BLOCK_N, warps, stages and INLINE (the same range sums in the same
    order, in one program). The decode tiles come from sweeps on an H200; the others follow
    gemm.py's reasoning."""
    split = split_k_for(n, k)
    swap = m <= SWAP_M_MAX
    if swap:  # decode: 16 activation rows against 64 weight rows a tile, the dot swapped (_k_blocks)
        bm, bn, warps, stages = SWAP_BLOCK_M, 64, 4, 3
    elif m <= SMALL_M_MAX:  # one row tile, narrow columns, split programs for bandwidth
        bm, bn, warps, stages = 64, DECODE_BLOCK_N, 4, 4
    elif m <= MID_M_MAX:
        bm, bn, warps, stages = 64, 128, 4, 3
    else:
        bm, bn, warps, stages = 128, 128, 8, 3
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    inline = split > 1 and (tiles >= TARGET_PROGRAMS // 2 or tiles > MAX_LOCKS)
    if m > SMALL_M_MAX:  # narrow the columns until about TARGET_PROGRAMS programs run
        per_tile = 1 if inline else split
        while bn > 32 and triton.cdiv(m, bm) * triton.cdiv(n, bn) * per_tile < TARGET_PROGRAMS:
            bn //= 2
    tma = m >= TMA_MIN_M and n >= TMA_MIN_N
    if tma:  # prefill: TMA_TILE, ranges added in the program
        (bm, bn, warps, stages), inline = TMA_TILE, True
    bn = min(bn, max(64 if swap else 16, triton.next_power_of_2(n)))  # a swapped tile's weight rows: >= 64
    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "SPLIT_K": split, "INLINE": inline, "SWAP": swap,
           "num_warps": warps, "num_stages": stages}
    if tma:
        cfg["TMA"] = True
    return cfg


def quantize_act(x: torch.Tensor, block_m: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group FP8 quantization: ``x [M, K]`` -> ``(xq float8_e4m3fn [M, K], xs float32
    [M, ceil(K/128)])`` with ``x ≈ xq * xs`` per group of 128 columns; a row's output depends on
    that row alone (``block_m`` rows per program: any value gives the same bits)."""
    assert x.dim() == 2 and x.stride(-1) == 1, "quantize_act: a 2-D activation with unit column stride"
    m, k = x.shape
    if block_m is None:  # (at M = 1, 64-row tiles took 3.9 us, 1-row tiles 1.1: section 32)
        block_m = min(QUANT_BLOCK_M, triton.next_power_of_2(triton.cdiv(max(m, 1), QUANT_ROW_PROGRAMS)))
    kb = triton.cdiv(k, BLOCK)
    xq = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    xs = torch.empty((m, kb), dtype=torch.float32, device=x.device)
    if m and k:
        _quant_kernel[(triton.cdiv(m, block_m), kb)](x, xq, xs, m, k, x.stride(0), xq.stride(0), xs.stride(0),
                                                       BLOCK_M=block_m, num_warps=4, **pdl())
    return xq, xs


def _check_weight(wq: torch.Tensor, ws: torch.Tensor, k: int) -> int:
    n = wq.shape[0]
    assert wq.dtype == torch.float8_e4m3fn and wq.dim() == 2 and wq.shape[1] == k and wq.stride(1) == 1, \
        f"weight: float8_e4m3fn [N, {k}] row-major, got {wq.dtype} {tuple(wq.shape)}"
    want = (triton.cdiv(n, BLOCK), triton.cdiv(k, BLOCK))
    assert ws.dtype == torch.float32 and tuple(ws.shape) == want and ws.stride(1) == 1, \
        f"weight_scale_inv: float32 {want}, got {ws.dtype} {tuple(ws.shape)}"
    return n


def check_wgmma_tile(block_m: int, block_n: int, swap: bool) -> None:
    """The in-block dot stays on the fp8 wgmma: its M side (BLOCK_M, or BLOCK_N when swapped) is a
    multiple of 64. Anything else compiles to mma.sync over fp16 upcasts, another in-block sum:
    on an H200 a swapped per-pair tile of 32 weight rows gave other bits (benchmarks section 32)."""
    side = block_n if swap else block_m
    assert side % 64 == 0, f"fp8 tile {block_m} x {block_n} (SWAP={swap}): the wgmma's M side must be a multiple of 64"


def _launch(a, a_scale, wq, ws, out, m, n, k, cfg):
    """a, a_scale: quantize_act's output."""
    check_wgmma_tile(cfg["BLOCK_M"], cfg["BLOCK_N"], cfg.get("SWAP", False))
    if cfg.get("TMA") and not cfg.get("SWAP") and _tma_ready(a, wq):
        return _launch_tma(a, a_scale, wq, ws, out, m, n, k, cfg)
    split = cfg["SPLIT_K"]
    kb_per_split = triton.cdiv(triton.cdiv(k, BLOCK), split)
    tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    # the same sums either way: INLINE needs no counters and no workspace (whose int32 offsets
    # split * M * N must stay below 2**31)
    inline = cfg["INLINE"] or (split > 1 and (tiles > MAX_LOCKS or split * m * n >= 2**31))
    grid_split = 1 if inline else split
    ws_buf = torch.empty((split, m, n), dtype=torch.float32, device=a.device) if grid_split > 1 else out
    locks = tile_locks(a.device) if grid_split > 1 else out
    _fp8_gemm_kernel[(tiles, grid_split)](
        a, a_scale, wq, ws, out, ws_buf, locks, m, n, k, kb_per_split, a.stride(0), a_scale.stride(0), wq.stride(0),
        ws.stride(0), out.stride(0), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], SPLIT_K=split, INLINE=inline,
        GROUP_M=8, DOT=dot_mode(torch.float8_e4m3fn), SWAP=cfg.get("SWAP", False), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **pdl())


def _launch_tma(a, a_scale, wq, ws, out, m, n, k, cfg):
    """The same tiles by TMA (``_fp8_gemm_tma_kernel``); a view without 16-byte aligned rows runs
    ``_fp8_gemm_kernel`` instead (``_tma_ready``), with the same bits."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, split = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["SPLIT_K"]
    _fp8_gemm_tma_kernel[(triton.cdiv(m, bm) * triton.cdiv(n, bn),)](
        TensorDescriptor.from_tensor(a, [bm, BLOCK]), a_scale, TensorDescriptor.from_tensor(wq, [bn, BLOCK]), ws, out,
        m, n, k, triton.cdiv(triton.cdiv(k, BLOCK), split), a_scale.stride(0), ws.stride(0), out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, SPLIT_K=split, GROUP_M=8, DOT=dot_mode(torch.float8_e4m3fn),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl())


def _out(m: int, n: int, dtype: torch.dtype, device, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty((m, n), dtype=dtype, device=device)
    assert out.shape == (m, n) and out.stride(1) == 1 and out.dtype == dtype, "out: [M, N], unit column stride"
    return out


def fp8_gemm(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
             out_dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None,
             config: dict | None = None) -> torch.Tensor:
    """``y[m, n] = Σ_kb (xq[m, kb] · wq[n, kb]) * xs[m, kb] * ws[n // 128, kb]`` in the module
    docstring's order: xq ``[M, K]`` float8_e4m3fn, xs ``[M, ceil(K/128)]`` float32, wq ``[N, K]``
    float8_e4m3fn, ws ``[ceil(N/128), ceil(K/128)]`` float32 -> ``[M, N]`` out_dtype."""
    m, k = xq.shape
    assert xq.dtype == torch.float8_e4m3fn and xq.stride(1) == 1, "xq: float8_e4m3fn [M, K], unit column stride"
    assert xs.dtype == torch.float32 and tuple(xs.shape) == (m, triton.cdiv(k, BLOCK)) and xs.stride(1) == 1, \
        "xs: float32 [M, ceil(K/128)], unit column stride"
    n = _check_weight(wq, ws, k)
    c = _out(m, n, out_dtype, xq.device, out)
    if m == 0 or n == 0:
        return c
    if k == 0:
        return c.zero_()
    _launch(xq, xs, wq, ws, c, m, n, k, config or fp8_config(m, n, k))
    return c


def fp8_linear(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, out: torch.Tensor | None = None,
               config: dict | None = None) -> torch.Tensor:
    """``x [..., K]`` (bf16/fp16/fp32) through a block-FP8 linear -> ``[..., N]`` in x's dtype:
    ``fp8_gemm(*quantize_act(x), wq, ws, x.dtype)``."""
    shape = x.shape
    a = x.reshape(-1, shape[-1])
    if a.stride(-1) != 1:
        a = a.contiguous()
    m, k = a.shape
    n = _check_weight(wq, ws, k)
    c = _out(m, n, x.dtype, x.device, out)
    if m and n and k:
        _launch(*quantize_act(a), wq, ws, c, m, n, k, config or fp8_config(m, n, k))
    elif m and n:
        c.zero_()
    return c.view(*shape[:-1], n)
