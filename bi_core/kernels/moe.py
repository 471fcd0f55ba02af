"""Routed MoE experts (plus the shared expert, folded in as expert E) as two grouped GEMMs over
(token, slot) pairs sorted by expert.

Routing (``align``) at decode and verify sizes is one Triton launch, a program per expert:
per-expert counts (``tl.histogram``), each expert's run padded to BLOCK_M rows, a stable
counting sort of the pairs (each program places its expert's pairs in pair order) and the
expert of every BLOCK_M block, with static shapes (CUDA-graph capturable); prefill-sized
batches get the same rows through torch ops. A
pair's result never depends on where it lands: every grouped-GEMM row is its own dot products
over K in the fixed order of ``gemm.py`` (BLOCK_K fixed by K), whatever BLOCK_M, the expert's
row count or the row's place in the tile. The first GEMM computes the gate and up halves of an
expert in one program and applies SiLU-and-mul in its epilogue. The k routed outputs of a token
are combined in fp32 in slot order, then the shared expert's output (weight sigmoid(gate
logit)) is added, with transformers' rounding."""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from bi_core.kernels.common import dot_mode, mma, pdl, pdl_start
from bi_core.kernels.gemm import MAX_LOCKS, block_k_for, block_m_for, tile_locks

SORT_CHUNK = 4096  # up to this many pairs one routing launch does it all (_align_kernel); more: _align_chunked
ROUTE_CHUNK = 1024  # pairs a program of _align_chunked counts and places


@attrs.frozen
class Routing:
    sorted_pairs: torch.Tensor  # [max_rows] int32, pair id (token * slots + slot) or num_pairs for padding
    block_expert: torch.Tensor  # [max_blocks] int32, expert of each BLOCK_M rows (>= num_experts: empty block)
    block_m: int
    num_pairs: int
    slots: int  # pairs per token: top_k, plus 1 with a shared expert


@triton.jit
def _expert_of(IDS, p, num_pairs, TOP_K: tl.constexpr, SLOTS: tl.constexpr, NUM_EXPERTS, E_BLOCK: tl.constexpr):
    """Expert of pairs ``p`` (token * SLOTS + slot): IDS[token, slot] for slot < TOP_K, else the
    shared expert NUM_EXPERTS - 1; E_BLOCK - 1 (a bin no expert has) past num_pairs."""
    ok = p < num_pairs
    slot = p % SLOTS
    e = tl.load(IDS + (p // SLOTS) * TOP_K + slot, mask=ok & (slot < TOP_K), other=NUM_EXPERTS - 1).to(tl.int32)
    return tl.where(ok, e, E_BLOCK - 1)


@triton.jit(do_not_specialize=["num_pairs", "max_rows", "max_blocks"])  # batch-dependent
def _align_kernel(IDS, SORTED, BLOCK_EXPERT, num_pairs, max_rows, max_blocks,
                  TOP_K: tl.constexpr, SLOTS: tl.constexpr, NUM_EXPERTS: tl.constexpr, E_BLOCK: tl.constexpr,
                  BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr, PDL: tl.constexpr, pdl_early):
    """One program per expert, plus one for the tail: every program counts all pairs per expert
    (a few KB from L2) to find where its expert's rows start; program e writes expert e's pairs
    in pair order (a stable counting sort), its padding rows and its blocks; the last program
    writes the rows and blocks past every expert's. Each row and block is written exactly once."""
    pdl_start(PDL, pdl_early)
    pid = tl.program_id(0)
    e_range = tl.arange(0, E_BLOCK)
    counts = tl.zeros((E_BLOCK,), tl.int32)
    for c0 in range(0, num_pairs, CHUNK):
        e = _expert_of(IDS, c0 + tl.arange(0, CHUNK), num_pairs, TOP_K, SLOTS, NUM_EXPERTS, E_BLOCK)
        counts += tl.histogram(e, E_BLOCK)
    counts = tl.where(e_range < NUM_EXPERTS, counts, 0)  # drop the padding bin
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    if pid < NUM_EXPERTS:
        mine_bin = e_range == pid
        start = tl.sum(tl.where(mine_bin, padded_end - padded, 0), axis=0)
        count = tl.sum(tl.where(mine_bin, counts, 0), axis=0)
        num_blocks = tl.sum(tl.where(mine_bin, padded, 0), axis=0) // BLOCK_M
        seen = 0
        for c0 in range(0, num_pairs, CHUNK):
            p = c0 + tl.arange(0, CHUNK)
            mine = _expert_of(IDS, p, num_pairs, TOP_K, SLOTS, NUM_EXPERTS, E_BLOCK) == pid
            rank = seen + tl.cumsum(mine.to(tl.int32), axis=0) - 1
            tl.store(SORTED + start + rank, p, mask=mine)
            seen += tl.sum(mine.to(tl.int32), axis=0)
        pad = count + tl.arange(0, BLOCK_M)  # the padding rows of the expert's last block
        tl.store(SORTED + start + pad, num_pairs, mask=pad < num_blocks * BLOCK_M)
        for b0 in range(0, num_blocks, FILL):
            b = b0 + tl.arange(0, FILL)
            tl.store(BLOCK_EXPERT + start // BLOCK_M + b, pid, mask=b < num_blocks)
    else:
        total = tl.sum(padded, axis=0)
        for r0 in range(0, max_rows, FILL):
            r = r0 + tl.arange(0, FILL)
            tl.store(SORTED + r, num_pairs, mask=(r >= total) & (r < max_rows))
        for b0 in range(0, max_blocks, FILL):
            b = b0 + tl.arange(0, FILL)
            tl.store(BLOCK_EXPERT + b, NUM_EXPERTS, mask=(b >= total // BLOCK_M) & (b < max_blocks))


def max_rows_for(num_pairs: int, num_experts: int, block_m: int) -> int:
    rows = min(num_pairs * block_m, num_pairs + num_experts * (block_m - 1))
    return triton.cdiv(rows, block_m) * block_m


def align(topk_ids: torch.Tensor, num_experts: int, shared: bool, max_block_m: int = 128) -> Routing:
    """Pairs sorted by expert in blocks of up to ``max_block_m`` rows; ``num_experts`` counts the
    shared expert (the last) when ``shared``. Up to SORT_CHUNK pairs (decode, verify) one Triton
    launch does it all; more (prefill) take two, chunk by chunk (``_align_chunked``). Both give the
    same rows (a stable sort by expert), and no row's result would depend on them anyway (see the
    module docstring)."""
    num_tokens, top_k = topk_ids.shape
    slots = top_k + (1 if shared else 0)
    num_pairs = num_tokens * slots
    bm = min(block_m_for(triton.cdiv(num_pairs, num_experts)), max_block_m)  # rows an expert: decode 16
    max_rows = max_rows_for(num_pairs, num_experts, bm)
    max_blocks = max_rows // bm
    dev = topk_ids.device
    if num_pairs > SORT_CHUNK:
        return _align_chunked(topk_ids, num_experts, slots, bm, max_rows)
    sorted_pairs = torch.empty(max_rows, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    if num_pairs:
        ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
        chunk = 256 if num_pairs <= 256 else 1024  # few sizes: few compiled variants
        _align_kernel[(num_experts + 1,)](ids, sorted_pairs, block_expert, num_pairs, max_rows, max_blocks,
                                          TOP_K=top_k, SLOTS=slots, NUM_EXPERTS=num_experts,
                                          E_BLOCK=triton.next_power_of_2(num_experts + 1), BLOCK_M=bm, CHUNK=chunk,
                                          FILL=1024, num_warps=4, **pdl())
    return Routing(sorted_pairs, block_expert, bm, num_pairs, slots)


@triton.jit(do_not_specialize=["num_pairs", "max_rows", "rows_per_program"])  # batch-dependent
def _align_count_kernel(IDS, COUNTS, SORTED, num_pairs, max_rows, rows_per_program, TOP_K: tl.constexpr,
                        SLOTS: tl.constexpr, NUM_EXPERTS: tl.constexpr, E_BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                        FILL: tl.constexpr, PDL: tl.constexpr, pdl_early):
    """Program c: chunk c's pairs counted per expert (COUNTS[c]), and its share of SORTED's rows set
    to the padding id (num_pairs), which ``_align_place_kernel`` then writes the pairs over."""
    pdl_start(PDL, pdl_early)
    c = tl.program_id(0)
    e = _expert_of(IDS, c * CHUNK + tl.arange(0, CHUNK), num_pairs, TOP_K, SLOTS, NUM_EXPERTS, E_BLOCK)
    tl.store(COUNTS + c * E_BLOCK + tl.arange(0, E_BLOCK), tl.histogram(e, E_BLOCK))
    lo = c * rows_per_program
    hi = tl.minimum(lo + rows_per_program, max_rows)
    for r0 in range(lo, hi, FILL):
        r = r0 + tl.arange(0, FILL)
        tl.store(SORTED + r, num_pairs, mask=r < hi)


@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "max_blocks"])  # batch-dependent
def _align_place_kernel(IDS, COUNTS, SORTED, BLOCK_EXPERT, num_pairs, num_chunks, max_blocks, TOP_K: tl.constexpr,
                        SLOTS: tl.constexpr, NUM_EXPERTS: tl.constexpr, E_BLOCK: tl.constexpr,
                        BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr, PDL: tl.constexpr,
                        pdl_early):
    """Program c < num_chunks: from every chunk's counts, where each expert's rows start (its
    count padded to BLOCK_M, in expert order) and how many of its pairs come before chunk c; then
    chunk c's pairs sorted by (expert, pair) and written there, each after the earlier pairs of
    its expert: the stable counting sort of ``_align_kernel``, the same rows. Program num_chunks:
    each block's expert (NUM_EXPERTS past the last expert's blocks)."""
    pdl_start(PDL, pdl_early)
    c = tl.program_id(0)
    e_range = tl.arange(0, E_BLOCK)
    total = tl.zeros((E_BLOCK,), dtype=tl.int32)
    before = tl.zeros((E_BLOCK,), dtype=tl.int32)
    for j in range(0, num_chunks):
        counts = tl.load(COUNTS + j * E_BLOCK + e_range)
        total += counts
        before += tl.where(j < c, counts, 0)
    total = tl.where(e_range < NUM_EXPERTS, total, 0)  # drop the padding bin
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.cumsum(padded, axis=0) - padded
    if c < num_chunks:
        local = tl.arange(0, CHUNK)
        e = _expert_of(IDS, c * CHUNK + local, num_pairs, TOP_K, SLOTS, NUM_EXPERTS, E_BLOCK)
        keys = tl.sort(e * CHUNK + local)  # by expert, then by pair: stable
        e_sorted = keys // CHUNK
        hist = tl.histogram(e, E_BLOCK)
        rank = local - tl.gather(tl.cumsum(hist, axis=0) - hist, e_sorted, 0)  # among the chunk's pairs of its expert
        row = tl.gather(start + before, e_sorted, 0) + rank
        tl.store(SORTED + row, c * CHUNK + keys % CHUNK, mask=e_sorted < NUM_EXPERTS)
    else:
        end = start + padded
        for b0 in range(0, max_blocks, FILL):
            b = b0 + tl.arange(0, FILL)
            done = (end[None, :] <= (b * BLOCK_M)[:, None]) & (e_range < NUM_EXPERTS)[None, :]
            tl.store(BLOCK_EXPERT + b, tl.sum(done.to(tl.int32), axis=1), mask=b < max_blocks)


def _align_chunked(topk_ids: torch.Tensor, num_experts: int, slots: int, bm: int, max_rows: int) -> Routing:
    """``align`` past SORT_CHUNK pairs (prefill): two launches over chunks of ROUTE_CHUNK pairs,
    whatever the count (before, about 25 torch ops a layer: host time in a host-bound prefill,
    benchmarks section 41), no host sync (CUDA graphs capture it)."""
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * slots
    dev = topk_ids.device
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    e_block = triton.next_power_of_2(num_experts + 1)
    chunks = triton.cdiv(num_pairs, ROUTE_CHUNK)
    max_blocks = max_rows // bm
    counts = torch.empty((chunks, e_block), dtype=torch.int32, device=dev)
    sorted_pairs = torch.empty(max_rows, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    meta = {"TOP_K": top_k, "SLOTS": slots, "NUM_EXPERTS": num_experts, "E_BLOCK": e_block, "CHUNK": ROUTE_CHUNK}
    _align_count_kernel[(chunks,)](ids, counts, sorted_pairs, num_pairs, max_rows, triton.cdiv(max_rows, chunks),
                                   FILL=1024, num_warps=4, **meta, **pdl())
    _align_place_kernel[(chunks + 1,)](ids, counts, sorted_pairs, block_expert, num_pairs, chunks, max_blocks,
                                       BLOCK_M=bm, FILL=64, num_warps=4, **meta, **pdl())
    return Routing(sorted_pairs, block_expert, bm, num_pairs, slots)


@triton.jit(do_not_specialize=["num_pairs"])
def _grouped_gemm_kernel(A, W, C, SORTED, BLOCK_EXPERT, IDS, num_pairs, N, K, num_experts, stride_am, stride_we,
                         stride_wn, stride_cm, A_ROW_DIV: tl.constexpr, SILU_MUL: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr, PER_PAIR: tl.constexpr,
                         TOP_K: tl.constexpr, SLOTS: tl.constexpr, E_BLOCK: tl.constexpr, PDL: tl.constexpr, pdl_early):
    pdl_start(PDL, pdl_early)
    b = tl.program_id(0)
    if PER_PAIR:  # small batches, no routing sort: program b computes pair b alone (row 0 of its tile)
        e = _expert_of(IDS, b, num_pairs, TOP_K, SLOTS, num_experts, E_BLOCK).to(tl.int64)
        pairs = tl.where(tl.arange(0, BLOCK_M) == 0, b, num_pairs)
    else:
        e = tl.load(BLOCK_EXPERT + b).to(tl.int64)
        if e >= num_experts:
            return
        pairs = tl.load(SORTED + b * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    a_rows = (pairs // A_ROW_DIV).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptr = A + a_rows[:, None] * stride_am + rk[None, :]
    w_ptr = W + e * stride_we + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]
    up_ptr = w_ptr + N * stride_wn  # SILU_MUL: rows [N, 2N) of the expert are the up projection
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = rk + k0 < K
        a = tl.load(a_ptr, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr, mask=(rn[None, :] < N) & k_ok[:, None], other=0.0)
        acc = mma(a, w, acc, DOT)
        if SILU_MUL:
            w_up = tl.load(up_ptr, mask=(rn[None, :] < N) & k_ok[:, None], other=0.0)
            acc_up = mma(a, w_up, acc_up, DOT)
            up_ptr += BLOCK_K
        a_ptr += BLOCK_K
        w_ptr += BLOCK_K
    dt = C.dtype.element_ty
    if SILU_MUL:  # the rounding of separate GEMMs + silu-and-mul: each GEMM output, silu(gate), the product
        gate = acc.to(dt).to(tl.float32)
        out = ((gate * tl.sigmoid(gate)).to(dt).to(tl.float32) * acc_up.to(dt).to(tl.float32)).to(dt)
    else:
        out = acc.to(dt)
    c_ptr = C + pairs[:, None].to(tl.int64) * stride_cm + rn[None, :]
    tl.store(c_ptr, out, mask=valid[:, None] & (rn[None, :] < N))


def grouped_config(block_m: int, n: int, silu_mul: bool) -> dict:
    """Tile width, warps and stages (speed only: BLOCK_K, fixed by (N, K), is the K order)."""
    block_n = 32 if block_m <= 16 else 64 if block_m <= 64 else 128
    return {"BLOCK_N": min(block_n, max(16, triton.next_power_of_2(n))),
            "num_warps": 8 if block_m == 128 else 4,  # prefill: [128, 128] fp32 accumulators (two with SiLU)
            "num_stages": 3 if silu_mul or block_m == 128 else 4}


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, routing: Routing, a_row_div: int, silu_mul: bool = False,
                 config: dict | None = None) -> torch.Tensor:
    """For every pair p: ``out[p] = a[p // a_row_div] @ w[expert(p)].T`` (w ``[E, N, K]``); with
    ``silu_mul`` w is ``[E, 2N, K]`` and ``out[p] = silu(gate) * up`` ``[num_pairs, N]``. ``config``
    overrides the tile table (benchmarks)."""
    num_experts, n, k = w.shape
    n = n // 2 if silu_mul else n
    out = torch.empty((routing.num_pairs, n), dtype=a.dtype, device=a.device)
    if routing.num_pairs == 0:
        return out
    cfg = config or grouped_config(routing.block_m, n, silu_mul)
    grid = (routing.block_expert.shape[0], triton.cdiv(n, cfg["BLOCK_N"]))
    _grouped_gemm_kernel[grid](a, w, out, routing.sorted_pairs, routing.block_expert, routing.sorted_pairs,
                               routing.num_pairs, n, k, num_experts, a.stride(0), w.stride(0), w.stride(1),
                               out.stride(0), A_ROW_DIV=a_row_div, SILU_MUL=silu_mul, BLOCK_M=routing.block_m,
                               BLOCK_K=block_k_for(n, k), DOT=dot_mode(a.dtype), PER_PAIR=False, TOP_K=1, SLOTS=1,
                               E_BLOCK=1, **cfg, **pdl())
    return out


@triton.jit
def _combine(Y, W, SHARED_LOGIT, t, cols, mask, H, stride_sl, dt: tl.constexpr, TOP_K: tl.constexpr,
             SLOTS: tl.constexpr, CACHE: tl.constexpr):
    """Token t's combined expert output for ``cols`` (fp32, not yet rounded), from its SLOTS rows of
    Y ``[T*SLOTS, H]``: Σ_j round(y_j * w_j) in fp32 in slot order, then + the shared expert's
    gated output, each rounded like transformers. The one copy of this arithmetic: the sorted and
    the per-pair paths must give the same bits."""
    acc = tl.zeros(cols.shape, tl.float32)
    for j in tl.static_range(TOP_K):  # slot order, fp32; weights applied in the model dtype
        w = tl.load(W + t * TOP_K + j).to(dt).to(tl.float32)
        y = tl.load(Y + (t * SLOTS + j) * H + cols, mask=mask, other=0.0, cache_modifier=CACHE).to(tl.float32)
        acc += (y * w).to(dt).to(tl.float32)
    if SLOTS > TOP_K:  # + sigmoid(shared gate logit) * shared expert, each rounded like transformers
        gate = tl.sigmoid(tl.load(SHARED_LOGIT + t * stride_sl).to(tl.float32)).to(dt).to(tl.float32)
        y = tl.load(Y + (t * SLOTS + TOP_K) * H + cols, mask=mask, other=0.0, cache_modifier=CACHE)
        acc = acc.to(dt).to(tl.float32) + (y.to(tl.float32) * gate).to(dt).to(tl.float32)
    return acc


PAIR_TOKENS = 8  # up to this many tokens the experts run per pair (no routing sort, combine fused)
# per-pair tiles (gemm_sweep.py pair, benchmarks section 11)
PAIR_UP = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 5}
PAIR_DOWN = {"BLOCK_N": 32, "num_warps": 2, "num_stages": 4}


@triton.jit
def _down_combine_kernel(HA, W2, Y, WTS, IDS, SHARED_LOGIT, OUT, LOCKS, N, K, num_experts, stride_h, stride_we,
                         stride_wn, stride_sl, TOP_K: tl.constexpr, SLOTS: tl.constexpr, E_BLOCK: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
                         PDL: tl.constexpr, pdl_early):
    """Program (pair p, column tile): the pair's down projection, as the grouped GEMM computes a
    row (the pair in row 0 of a BLOCK_M tile, K in BLOCK_K steps), stored rounded to Y; the last
    of a token's SLOTS programs to arrive (a per-(token, tile) counter, left at zero) combines the
    token's rows of Y in slot order (``_combine``, as the sorted path). The counter elects who
    adds; it orders nothing arithmetic."""
    pdl_start(PDL, pdl_early)
    p = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    t = p // SLOTS
    rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    row0 = tl.arange(0, BLOCK_M) == 0
    n_ok = rn < N
    dt = OUT.dtype.element_ty
    e = _expert_of(IDS, p, p + 1, TOP_K, SLOTS, num_experts, E_BLOCK).to(tl.int64)
    a_ptr = HA + p * stride_h + rk[None, :]
    w_ptr = W2 + e * stride_we + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = rk + k0 < K
        a = tl.load(a_ptr, mask=row0[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc = mma(a, w, acc, DOT)
        a_ptr += BLOCK_K
        w_ptr += BLOCK_K
    y_ptr = Y + p * N + tl.arange(0, BLOCK_M)[:, None] * 0 + rn[None, :]
    tl.store(y_ptr, acc.to(dt), mask=row0[:, None] & n_ok[None, :])
    tl.debug_barrier()  # every thread's row is written before the arrival is counted
    lock = LOCKS + t * tl.num_programs(1) + tile
    if tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu") == SLOTS - 1:
        total = _combine(Y, WTS, SHARED_LOGIT, t, rn, n_ok, N, stride_sl, dt, TOP_K, SLOTS, ".cg")  # from L2
        tl.store(OUT + t * N + rn, total.to(dt), mask=n_ok)
        tl.atomic_xchg(lock, 0)  # left at zero for the next call (and graph replays)


def _moe_per_pair(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor, shared_logits: torch.Tensor | None, up: dict = PAIR_UP, down: dict = PAIR_DOWN
                  ) -> torch.Tensor:
    """Two launches for a few tokens, no routing sort: the gate/up GEMM a program per (pair, column
    tile), then the down GEMM a program per (pair, column tile), the last of a token's pairs
    combining them. Every number is computed as on the sorted path (the same row arithmetic,
    the same roundings): tests/gpu checks the two bitwise."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    slots = top_k + (1 if shared_logits is not None else 0)
    num_pairs = num_tokens * slots
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    e_block = triton.next_power_of_2(num_experts + 1)
    h = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    dot = dot_mode(x.dtype)
    _grouped_gemm_kernel[(num_pairs, triton.cdiv(inter, up["BLOCK_N"]))](
        x, w13, h, ids, ids, ids, num_pairs, inter, hidden, num_experts, x.stride(0), w13.stride(0), w13.stride(1),
        h.stride(0), A_ROW_DIV=slots, SILU_MUL=True, BLOCK_M=16, BLOCK_K=block_k_for(inter, hidden), DOT=dot,
        PER_PAIR=True, TOP_K=top_k, SLOTS=slots, E_BLOCK=e_block, **up, **pdl())
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    y = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    assert num_tokens * triton.cdiv(hidden, down["BLOCK_N"]) <= MAX_LOCKS  # a counter per (token, column tile)
    logits = shared_logits if shared_logits is not None else topk_weights
    _down_combine_kernel[(num_pairs, triton.cdiv(hidden, down["BLOCK_N"]))](
        h, w2, y, topk_weights.contiguous(), ids, logits, out, tile_locks(x.device), hidden, inter, num_experts,
        h.stride(0), w2.stride(0), w2.stride(1), logits.stride(0), TOP_K=top_k, SLOTS=slots, E_BLOCK=e_block,
        BLOCK_M=16, BLOCK_K=block_k_for(hidden, inter), DOT=dot, **down, **pdl())
    return out


@triton.jit
def _combine_kernel(Y, W, SHARED_LOGIT, OUT, H, stride_sl, TOP_K: tl.constexpr, SLOTS: tl.constexpr,
                    BLOCK: tl.constexpr, PDL: tl.constexpr, pdl_early):
    pdl_start(PDL, pdl_early)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    dt = OUT.dtype.element_ty
    acc = _combine(Y, W, SHARED_LOGIT, t, cols, mask, H, stride_sl, dt, TOP_K, SLOTS, "")
    tl.store(OUT + t * H + cols, acc.to(dt), mask=mask)


def moe_combine(y: torch.Tensor, weights: torch.Tensor, shared_logits: torch.Tensor | None = None) -> torch.Tensor:
    """``Σ_j round(y[t, j] * w[t, j])`` in fp32 in slot order (+ the shared expert's gated output,
    row ``top_k`` of each token, when ``shared_logits [T]`` is given); y ``[T*slots, H]``."""
    rows, top_k = weights.shape
    h = y.shape[1]
    slots = top_k + (0 if shared_logits is None else 1)
    out = torch.empty((rows, h), dtype=y.dtype, device=y.device)
    if rows:
        block = min(1024, triton.next_power_of_2(h))
        logits = shared_logits if shared_logits is not None else weights
        _combine_kernel[(rows, triton.cdiv(h, block))](y, weights.contiguous(), logits, out, h, logits.stride(0),
                                                       TOP_K=top_k, SLOTS=slots, BLOCK=block, num_warps=4, **pdl())
    return out


def fused_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
              w2: torch.Tensor, shared_logits: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_j w_j · SwiGLU-expert_{id_j}(x) per token, combined in fp32 in slot order; with
    ``shared_logits`` the last expert of w13/w2 is the shared expert, gated by sigmoid(logit).
    Up to PAIR_TOKENS tokens per pair (2 launches), more sorted by expert (4 launches): the same
    bits either way."""
    if 0 < topk_ids.shape[0] <= PAIR_TOKENS:
        return _moe_per_pair(x, topk_weights, topk_ids, w13, w2, shared_logits)
    return _moe_sorted(x, topk_weights, topk_ids, w13, w2, shared_logits)


def _moe_sorted(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor, shared_logits: torch.Tensor | None) -> torch.Tensor:
    routing = align(topk_ids, w13.shape[0], shared=shared_logits is not None)
    h = grouped_gemm(x, w13, routing, a_row_div=routing.slots, silu_mul=True)
    y = grouped_gemm(h, w2, routing, a_row_div=1)
    return moe_combine(y, topk_weights, shared_logits)
