"""Paged causal attention (GQA), two kernels, each row's arithmetic fixed by the row alone.

Decode/verify rows (recurrent sequences of at most ``DECODE_TOKENS`` query tokens) split their
KV into fixed chunks of ``KV_SPLIT`` tokens: for chunks 0, 1, ... (chunk c covers positions
[c * KV_SPLIT, (c + 1) * KV_SPLIT)), an online softmax over that chunk's fixed BLOCK_N blocks
gives (m, l, acc), written to a workspace by one of several programs per (sequence, KV head); a
merge kernel folds the chunks in chunk order into (M, L, ACC) with explicit FMAs; the output is
ACC / L, times sigmoid(gate) (Qwen3.5's output gate). A row with more than ``MERGE_RUN`` chunks
(a long context: one program per head folding a thousand chunks in series was the merge's whole
time) folds them in two fixed levels: each run of ``MERGE_RUN`` chunks in order, in parallel
(``_merge_runs_kernel``), then the runs' results in order; which level a row takes, and where a
run starts, follow from the row's own position. The split size is fixed, so neither the
number of chunks nor the fold depends on the batch (FlashInfer's ``fixed_split_size`` idea), and
how many programs share a sequence's chunks changes no bit. Blocks past a row's position are
fully masked and leave it exactly unchanged, and empty chunks fold as exact no-ops. Workspace
slots are laid out by an in-kernel prefix sum over the decode sequences' own lengths: no
per-step host metadata.

Prompt rows (a chunk of a prompt, not recurrent) run ``_prefill_fa_kernel``: one online softmax
over the row's KV in blocks of ``PREFILL_BLOCK_N`` keys from position 0, in
``PREFILL_M_ROWS``-row tiles of one sequence's tokens x the GROUP query heads of a KV head
(FlashAttention's loop: no chunk fold, the diagonal blocks alone masked). A row's operations
depend on its own position only (block edges are multiples of the block from 0; a block past the
row's position is an exact no-op; masked and unmasked blocks run the same operations), so a
prompt row gets the same bits alone, beside any batch and in chunks of any size; but not the
decode kernel's bits (other block edges, no KV_SPLIT-key fold). That costs no guarantee: whether a
token runs as a prompt row or a decode/verify row is fixed by its request alone (prompt tokens in
prompt chunks, generated tokens in decode form, exact scoring and preemption rebuilds included),
and the GDN layers' chunked and recurrent forms already differ. It buys the prompt rows' speed:
the decode kernel's fold over 32-key blocks, which prompt tiles used to run, took 1.5-4.8x
FlashInfer's time at long contexts; this kernel takes 0.95-1.11x (benchmarks section 17).

An FP8 cache (ops/attention.py's ``KV_CACHE_DTYPES``: e4m3 at scale 1) is read as its exact
values in q's dtype; the arithmetic after the loads is the same as for a cache in q's dtype.
Except in the decode kernel of a bf16 model (``FP8_KV_F16``): there q is converted to float16 once
per program and the cache's values to float16 (one ``cvt.rn.f16x2.e4m3x2`` per two values; to
bf16 it takes four instructions, which made FP8 decode slower than bf16 at 131k tokens, benchmarks
section 34), so both dots run in float16. Exact for the cache; q keeps its bits for |q| in
[2^-17, 65504] (after the q norm |q| <= sqrt(D) * max|1 + w|: 16 * max|1 + w| at D = 256), and
p in float16 carries more mantissa than in bf16. Fixed per row like everything else."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bi_core.kernels.common import dot_mode, mma, pdl, pdl_start

M_ROWS = 64  # rows per program (tokens per tile = M_ROWS // GROUP)
# prompt rows (``_prefill_fa_kernel``): tile rows, keys per block (part of a prompt row's
# arithmetic), warps and pipeline stages
PREFILL_M_ROWS, PREFILL_BLOCK_N, PREFILL_WARPS, PREFILL_STAGES = 128, 64, 8, 3
BLOCK_N = 32
# tokens per KV chunk: fixed, part of every row's arithmetic. 128, not 256: at B=1 / 512 tokens a
# (KV head, chunk) program's serial fold over 32-key blocks was the layer's attention time (4
# programs, 20 us): FP8 35B-A3B decode B=1 / 8 -0.07 / -0.08 ms, B=64 flat; at 32k tokens B=1
# -2.4%, B=8 / 32 +3.2 / +2.0% (twice the partials to write and merge); 64 lost at 32k
# (benchmarks section 44)
KV_SPLIT = 128
LOG2E = 1.4426950408889634
# decode rows of a bf16 model over an FP8 cache: the dots in float16 (module docstring); part of
# such a row's arithmetic
FP8_KV_F16 = True
DECODE_MIN_ROWS = 16  # decode tiles: GROUP x tokens query rows, at least one MMA tile of 16
DECODE_WARPS, DECODE_STAGES = 2, 2
PREFIX_BLOCK = 64  # sequences summed per step of the in-kernel workspace prefix sum
MERGE_STAGES, MERGE_PIPELINED_PROGRAMS = 6, 512  # merge: chunk loads in flight, up to this many programs
# a row with more chunks than this (contexts over 2,048 tokens) merges them in runs of this many
# first: part of such a row's arithmetic (a row with fewer keeps the one-level fold's bits)
MERGE_RUN = 16
# run-merge programs wanted (scheduling only): 2,112 (16 an SM) rather than 528 keep more of the
# partials' loads in flight (131k tokens, B=4 / 8 / 32: 17.7 -> 10.8, 30.6 -> 20.1, 83.0 -> 71.5 µs;
# benchmarks section 27)
RUN_PROGRAMS = 2112
RUN_STAGES = 4  # the run merge's chunk loads in flight (8: no better with 2,112 programs); scheduling only
# warps of the run merge and the merge: their arithmetic is elementwise over a row's (tokens, D)
# tile, so the layout changes no bit; fewer warps load wider vectors per thread. Scheduling only
MERGE_WARPS = 1


@triton.jit
def _attend_chunk(q, KC, VC, bt_row, kvh, pos, lo, hi, scale_log2, stride_kb, stride_ko, stride_kh,
                  PAGE: tl.constexpr, D: tl.constexpr, M_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                  DOT: tl.constexpr):
    """Online softmax of the rows (positions ``pos``) over KV positions [lo, hi): (m, l, acc)."""
    d = tl.arange(0, D)
    m_i = tl.full((M_ROWS,), float("-inf"), tl.float32)
    l_i = tl.zeros((M_ROWS,), tl.float32)
    acc = tl.zeros((M_ROWS, D), tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        idx = n0 + tl.arange(0, BLOCK_N)
        in_kv = idx < hi
        page = tl.load(bt_row + idx // PAGE, mask=in_kv, other=0).to(tl.int64)
        off = page * stride_kb + (idx % PAGE) * stride_ko + kvh * stride_kh
        # an FP8 cache's values convert exactly (a no-op for a cache in q's dtype)
        k = tl.load(KC + off[:, None] + d[None, :], mask=in_kv[:, None], other=0.0).to(q.dtype)
        v = tl.load(VC + off[:, None] + d[None, :], mask=in_kv[:, None], other=0.0).to(q.dtype)
        scores = mma(q, tl.trans(k), tl.zeros((M_ROWS, BLOCK_N), tl.float32), DOT) * scale_log2
        visible = (idx[None, :] <= pos[:, None]) & in_kv[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None], DOT)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _fold(m_all, l_all, acc_all, m, l_c, acc):
    """Fold one chunk's (m, l, acc) into the running result; an empty chunk (m = -inf) is an
    exact no-op. Explicit FMAs so every kernel that folds rounds the same way."""
    m_new = tl.maximum(m_all, m)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp2(m_all - m_safe)
    b = tl.exp2(m - m_safe)
    l_all = tl.fma(l_all, a, l_c * b)
    acc_all = tl.fma(acc_all, a[:, None], acc * b[:, None])
    return m_new, l_all, acc_all


@triton.jit
def _gated_store(OUT, G, rows, head, d, acc, denom, mask, stride_ot, stride_gt, D: tl.constexpr):
    """``out = (acc / denom) * sigmoid(gate)`` with transformers' rounding (each factor in bf16)."""
    o = (acc / tl.where(denom == 0.0, 1.0, denom)[:, None]).to(OUT.dtype.element_ty).to(tl.float32)
    g = tl.load(G + rows[:, None] * stride_gt + head[:, None] * (2 * D) + d[None, :], mask=mask, other=0.0)
    gate = tl.sigmoid(g.to(tl.float32)).to(OUT.dtype.element_ty).to(tl.float32)
    ptr = OUT + rows[:, None] * stride_ot + head[:, None] * D + d[None, :]
    tl.store(ptr, (o * gate).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _fa_block(q, KC, VC, bt_row, kvh, pos, n0, kv_end, m_i, l_i, acc, scale_log2, stride_kb, stride_ko, stride_kh,
              PAGE: tl.constexpr, D: tl.constexpr, M_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
              MASK: tl.constexpr, DOT: tl.constexpr):
    """One KV block [n0, n0 + BLOCK_N) of a prompt tile's online softmax. MASK: the block may hold
    keys past a row's position or past ``kv_end`` (the same operations on every visible key)."""
    d = tl.arange(0, D)
    idx = n0 + tl.arange(0, BLOCK_N)
    if MASK:
        in_kv = idx < kv_end
        page = tl.load(bt_row + idx // PAGE, mask=in_kv, other=0).to(tl.int64)
        off = page * stride_kb + (idx % PAGE) * stride_ko + kvh * stride_kh
        k = tl.load(KC + off[:, None] + d[None, :], mask=in_kv[:, None], other=0.0).to(q.dtype)
        v = tl.load(VC + off[:, None] + d[None, :], mask=in_kv[:, None], other=0.0).to(q.dtype)
    else:
        page = tl.load(bt_row + idx // PAGE).to(tl.int64)
        off = page * stride_kb + (idx % PAGE) * stride_ko + kvh * stride_kh
        k = tl.load(KC + off[:, None] + d[None, :]).to(q.dtype)  # FP8 caches: exact (see _attend_chunk)
        v = tl.load(VC + off[:, None] + d[None, :]).to(q.dtype)
    qk = mma(q, tl.trans(k), tl.zeros((M_ROWS, BLOCK_N), tl.float32), DOT)
    if MASK:  # a visible key's value passes unchanged: masked and unmasked blocks run the same operations
        qk = tl.where((idx[None, :] <= pos[:, None]) & in_kv[None, :], qk, float("-inf"))
    # scale > 0: the max of the scaled scores is the scaled max, exactly. The exponent is an
    # explicit fma, so no fp-fusion choice of the compiler can round one loop differently from the
    # other (measured: with `qk * scale - m` the unmasked loop got an fma and the masked one did
    # not, and a row's bits followed its tile's first position)
    m_new = tl.maximum(m_i, tl.max(qk, axis=1) * scale_log2)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(tl.fma(qk, scale_log2, -m_safe[:, None]))
    l_i = tl.fma(l_i, alpha, tl.sum(p, axis=1))
    acc = mma(p.to(v.dtype), v, acc * alpha[:, None], DOT)
    return m_new, l_i, acc


@triton.jit
def _prefill_fa_kernel(Q, KC, VC, G, OUT, BT, CTX, CU, TILE_SEQ, TILE_START, scale_log2,
                       stride_qt, stride_qh, stride_gt, stride_ot, stride_kb, stride_ko, stride_kh, stride_bt,
                       PAGE: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, M_ROWS: tl.constexpr,
                       BLOCK_N: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr, pdl_early):
    """Prompt rows: one program per (tile of M_ROWS // GROUP query tokens x the GROUP heads of a KV
    head). Blocks wholly at or before the tile's first position need no mask; the rest do."""
    pdl_start(PDL, pdl_early)
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.load(TILE_SEQ + tile).to(tl.int64)
    t0 = tl.load(TILE_START + tile)
    q_start = tl.load(CU + s)
    q_len = tl.load(CU + s + 1) - q_start
    ctx = tl.load(CTX + s)
    past = ctx - q_len
    r = tl.arange(0, M_ROWS)
    tok = t0 + r // GROUP
    head = kvh * GROUP + r % GROUP
    row_ok = tok < q_len
    pos = past + tok
    d = tl.arange(0, D)
    rows = (q_start + tok).to(tl.int64)
    q = tl.load(Q + rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
    kv_end = tl.minimum(ctx, past + t0 + M_ROWS // GROUP)
    full_end = (past + t0 + 1) // BLOCK_N * BLOCK_N  # keys < full_end are visible to every row of the tile
    bt_row = BT + s * stride_bt
    m_i = tl.full((M_ROWS,), float("-inf"), tl.float32)
    l_i = tl.zeros((M_ROWS,), tl.float32)
    acc = tl.zeros((M_ROWS, D), tl.float32)
    for n0 in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _fa_block(q, KC, VC, bt_row, kvh, pos, n0, kv_end, m_i, l_i, acc, scale_log2, stride_kb,
                                  stride_ko, stride_kh, PAGE, D, M_ROWS, BLOCK_N, False, DOT)
    for n0 in range(full_end, kv_end, BLOCK_N):
        m_i, l_i, acc = _fa_block(q, KC, VC, bt_row, kvh, pos, n0, kv_end, m_i, l_i, acc, scale_log2, stride_kb,
                                  stride_ko, stride_kh, PAGE, D, M_ROWS, BLOCK_N, True, DOT)
    _gated_store(OUT, G, rows, head, d, acc, l_i, row_ok[:, None], stride_ot, stride_gt, D)


@triton.jit
def _chunks_before(CTX, CU, DEC_SEQS, i, KV_SPLIT: tl.constexpr, DECODE_TOKENS: tl.constexpr,
                   BLOCK_B: tl.constexpr):
    """Workspace slots used by decode sequences DEC_SEQS[0:i]: each token needs one slot per chunk
    of its own KV (its position + 1 keys)."""
    total = tl.zeros((), tl.int64)
    for j0 in range(0, i, BLOCK_B):
        j = j0 + tl.arange(0, BLOCK_B)
        ok = j < i
        sj = tl.load(DEC_SEQS + j, mask=ok, other=0).to(tl.int64)
        q_len = tl.load(CU + sj + 1, mask=ok, other=0) - tl.load(CU + sj, mask=ok, other=0)
        past = tl.load(CTX + sj, mask=ok, other=0) - q_len
        for u in tl.static_range(DECODE_TOKENS):
            total += tl.sum(tl.where(ok & (u < q_len), (past + u + KV_SPLIT) // KV_SPLIT, 0), axis=0).to(tl.int64)
    return total


@triton.jit
def _slot_of(past, tok, KV_SPLIT: tl.constexpr, DECODE_TOKENS: tl.constexpr):
    """Slots used by the tokens of the same sequence before ``tok`` (vector over rows)."""
    before = (tok * 0).to(tl.int64)
    for u in tl.static_range(DECODE_TOKENS):
        before += tl.where(u < tok, (past + u + KV_SPLIT) // KV_SPLIT, 0)
    return before


@triton.jit
def _decode_split_kernel(Q, KC, VC, WS_ACC, WS_M, WS_L, BT, CTX, CU, DEC_SEQS, scale_log2,
                         stride_qt, stride_qh, stride_kb, stride_ko, stride_kh, stride_bt, num_heads,
                         PAGE: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, M_ROWS: tl.constexpr,
                         BLOCK_N: tl.constexpr, KV_SPLIT: tl.constexpr, DECODE_TOKENS: tl.constexpr,
                         BLOCK_B: tl.constexpr, DOT: tl.constexpr, Q_F16: tl.constexpr, PDL: tl.constexpr,
                         pdl_early):
    """Chunk partials of decode sequence DEC_SEQS[program_id(2)] at KV head program_id(0): chunks p,
    p + P, p + 2P, ... for p = program_id(1) of P. The KV head is the fastest axis (scheduling only):
    a token's KV heads, the parts of one row of the cache, are streamed by neighbouring programs
    at the same time (1.3% faster at 131k than the head-slowest order; benchmarks section 27)."""
    pdl_start(PDL, pdl_early)
    kvh = tl.program_id(0)
    p = tl.program_id(1)
    i = tl.program_id(2)
    num_p = tl.num_programs(1)
    s = tl.load(DEC_SEQS + i).to(tl.int64)
    q_start = tl.load(CU + s)
    q_len = tl.load(CU + s + 1) - q_start
    ctx = tl.load(CTX + s)
    past = ctx - q_len
    r = tl.arange(0, M_ROWS)
    tok = r // GROUP
    head = kvh * GROUP + r % GROUP
    row_ok = tok < q_len
    pos = past + tok
    d = tl.arange(0, D)
    rows = (q_start + tok).to(tl.int64)
    q = tl.load(Q + rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
    if Q_F16:  # an FP8 cache under a bf16 model: the dots in float16 (FP8_KV_F16)
        q = q.to(tl.float16)
    slot0 = _chunks_before(CTX, CU, DEC_SEQS, i, KV_SPLIT, DECODE_TOKENS, BLOCK_B) + \
        _slot_of(past, tok, KV_SPLIT, DECODE_TOKENS)
    for c in range(p, tl.cdiv(ctx, KV_SPLIT), num_p):
        lo = c * KV_SPLIT
        m, l_c, acc = _attend_chunk(q, KC, VC, BT + s * stride_bt, kvh, pos, lo, tl.minimum(lo + KV_SPLIT, ctx),
                                  scale_log2, stride_kb, stride_ko, stride_kh, PAGE, D, M_ROWS, BLOCK_N, DOT)
        keep = row_ok & (pos >= lo)  # chunk c exists for this row
        unit = ((slot0 + c) * num_heads + head).to(tl.int64)
        tl.store(WS_M + unit, m, mask=keep)
        tl.store(WS_L + unit, l_c, mask=keep)
        tl.store(WS_ACC + unit[:, None] * D + d[None, :], acc, mask=keep[:, None])


@triton.jit
def _merge_runs_kernel(WS_ACC, WS_M, WS_L, CTX, CU, DEC_SEQS, num_heads, D: tl.constexpr, KV_SPLIT: tl.constexpr,
                        DECODE_TOKENS: tl.constexpr, BLOCK_B: tl.constexpr, RUN: tl.constexpr,
                        STAGES: tl.constexpr, PDL: tl.constexpr, pdl_early):
    """The first level of a long row's merge: for each run of RUN chunks of a row with more
    than RUN, fold the run's partials in chunk order and write the result over the run's first
    chunk's partial. Programs (axis 2) take runs in turn: only the order within a run is
    arithmetic. Rows with RUN chunks or fewer are left alone (the merge folds their chunks)."""
    pdl_start(PDL, pdl_early)
    i = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2)
    s = tl.load(DEC_SEQS + i).to(tl.int64)
    q_start = tl.load(CU + s)
    q_len = tl.load(CU + s + 1) - q_start
    ctx = tl.load(CTX + s)
    past = ctx - q_len
    tok = tl.arange(0, DECODE_TOKENS)
    pos = past + tok
    long_row = (tok < q_len) & (pos // KV_SPLIT + 1 > RUN)
    d = tl.arange(0, D)
    slot0 = _chunks_before(CTX, CU, DEC_SEQS, i, KV_SPLIT, DECODE_TOKENS, BLOCK_B) + \
        _slot_of(past, tok, KV_SPLIT, DECODE_TOKENS)
    if (ctx - 1) // KV_SPLIT + 1 > RUN:  # the sequence's last row has runs
        for g in range(p, tl.cdiv(tl.cdiv(ctx, KV_SPLIT), RUN), tl.num_programs(2)):
            m_all = tl.full((DECODE_TOKENS,), float("-inf"), tl.float32)
            l_all = tl.zeros((DECODE_TOKENS,), tl.float32)
            acc_all = tl.zeros((DECODE_TOKENS, D), tl.float32)
            for j in tl.range(0, RUN, num_stages=STAGES):
                c = g * RUN + j
                keep = long_row & (pos >= c * KV_SPLIT)
                unit = ((slot0 + c) * num_heads + h).to(tl.int64)
                m = tl.load(WS_M + unit, mask=keep, other=float("-inf"))
                l_c = tl.load(WS_L + unit, mask=keep, other=0.0)
                acc = tl.load(WS_ACC + unit[:, None] * D + d[None, :], mask=keep[:, None], other=0.0)
                m_all, l_all, acc_all = _fold(m_all, l_all, acc_all, m, l_c, acc)
            # the result overwrites chunk g * RUN's partial, which every warp loads (m and l are
            # replicated across warps): no warp may store before all have loaded it. Without this
            # barrier a warp that ran ahead overwrote it under another's load (B=64 at 131k:
            # 128-311 output elements differed call to call; benchmarks section 23)
            tl.debug_barrier()
            first = long_row & (pos >= g * RUN * KV_SPLIT)
            unit = ((slot0 + g * RUN) * num_heads + h).to(tl.int64)
            tl.store(WS_M + unit, m_all, mask=first)
            tl.store(WS_L + unit, l_all, mask=first)
            tl.store(WS_ACC + unit[:, None] * D + d[None, :], acc_all, mask=first[:, None])


@triton.jit
def _merge_kernel(WS_ACC, WS_M, WS_L, G, OUT, CTX, CU, DEC_SEQS, stride_gt, stride_ot, num_heads,
                  D: tl.constexpr, KV_SPLIT: tl.constexpr, DECODE_TOKENS: tl.constexpr, BLOCK_B: tl.constexpr,
                  RUN: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr, pdl_early):
    """Fold a (sequence, head)'s partials in chunk order (a long row: its runs' results, which
    ``_merge_runs_kernel`` wrote), with ``STAGES`` loads in flight (scheduling only: the fold and
    its bits are the same for any STAGES)."""
    pdl_start(PDL, pdl_early)
    i = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.load(DEC_SEQS + i).to(tl.int64)
    q_start = tl.load(CU + s)
    q_len = tl.load(CU + s + 1) - q_start
    ctx = tl.load(CTX + s)
    past = ctx - q_len
    tok = tl.arange(0, DECODE_TOKENS)
    row_ok = tok < q_len
    pos = past + tok
    d = tl.arange(0, D)
    slot0 = _chunks_before(CTX, CU, DEC_SEQS, i, KV_SPLIT, DECODE_TOKENS, BLOCK_B) + \
        _slot_of(past, tok, KV_SPLIT, DECODE_TOKENS)
    m_all = tl.full((DECODE_TOKENS,), float("-inf"), tl.float32)
    l_all = tl.zeros((DECODE_TOKENS,), tl.float32)
    acc_all = tl.zeros((DECODE_TOKENS, D), tl.float32)
    # a row's partials: its chunks, or with more than RUN its runs' results (at each run's first chunk)
    n_chunks = pos // KV_SPLIT + 1
    long_row = n_chunks > RUN
    stride = tl.where(long_row, RUN, 1)
    count = tl.where(row_ok, tl.where(long_row, (n_chunks + RUN - 1) // RUN, n_chunks), 0)
    # the fold is serial, the loads are not: a long context's merge waited on one load at a time
    for k in tl.range(0, tl.max(count, axis=0), num_stages=STAGES):
        keep = k < count
        unit = ((slot0 + k * stride) * num_heads + h).to(tl.int64)
        m = tl.load(WS_M + unit, mask=keep, other=float("-inf"))
        l_c = tl.load(WS_L + unit, mask=keep, other=0.0)
        acc = tl.load(WS_ACC + unit[:, None] * D + d[None, :], mask=keep[:, None], other=0.0)
        m_all, l_all, acc_all = _fold(m_all, l_all, acc_all, m, l_c, acc)
    rows = (q_start + tok).to(tl.int64)
    _gated_store(OUT, G, rows, tok * 0 + h, d, acc_all, l_all, row_ok[:, None], stride_ot, stride_gt, D)


def decode_rows(q_len: int, group: int) -> int:
    """MMA rows of the decode-form tile that runs ``q_len`` query tokens of ``group`` heads each (a
    power of two when ``group`` is one: ``tl.arange`` spans them)."""
    return max(DECODE_MIN_ROWS, triton.next_power_of_2(max(q_len, 1)) * group)


def tokens_per_tile(num_heads: int, num_kv_heads: int) -> int:
    """Query tokens of one decode-form tile (recurrent rows up to this many run in decode form)."""
    return M_ROWS // (num_heads // num_kv_heads)


def prefill_config(num_heads: int, num_kv_heads: int) -> dict:
    """The prompt kernel's tile: M_ROWS (>= GROUP, a power of two), BLOCK_N (part of a prompt
    row's arithmetic), warps, stages (the module's PREFILL_* values, read at call time: sweeps
    set them)."""
    return {"M_ROWS": max(PREFILL_M_ROWS, triton.next_power_of_2(num_heads // num_kv_heads)),
            "BLOCK_N": PREFILL_BLOCK_N, "num_warps": PREFILL_WARPS, "num_stages": PREFILL_STAGES}


def prefill_tile_tokens(num_heads: int, num_kv_heads: int) -> int:
    """Query tokens of one prompt tile (``make_tiles`` for ``prefill_attention``)."""
    return prefill_config(num_heads, num_kv_heads)["M_ROWS"] // (num_heads // num_kv_heads)


def make_tiles(query_lens: list[int], seqs: list[int], tile_tokens: int, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, first token) of every query tile of the sequences ``seqs``; host-side."""
    tile_seq, starts = [], []
    for i in seqs:
        for t in range(0, query_lens[i], tile_tokens):
            tile_seq.append(i)
            starts.append(t)
    return (torch.tensor(tile_seq, dtype=torch.int32, device=device),
            torch.tensor(starts, dtype=torch.int32, device=device))


def workspace_slots(num_tokens: int, chunks: int, max_q_len: int) -> int:
    """An upper bound of the chunk slots a decode step can need: one per token, plus one per
    query position of each of the ``chunks`` KV chunks the sequences read. (Not bounded by the
    cache's size: sequences sharing pages read the same keys, each its own partials.)"""
    return num_tokens + max_q_len * chunks


def prefill_attention(q, k_cache, v_cache, gate, out, block_tables, context_lens, cu_seqlens, tile_seq,
                      tile_start, scale: float) -> None:
    """Gated attention for prompt tiles (``make_tiles`` with ``prefill_tile_tokens``). q ``[T, Hq,
    D]``, gate ``[T, *]`` (head h's gate at columns ``h*2D + D ...``, as q_proj lays it out), out
    ``[T, Hq*D]``."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    if tile_seq.shape[0] == 0:
        return
    cfg = prefill_config(num_heads, num_kv_heads)
    _prefill_fa_kernel[(tile_seq.shape[0], num_kv_heads)](
        q, k_cache, v_cache, gate, out, block_tables, context_lens, cu_seqlens, tile_seq, tile_start,
        scale * LOG2E, q.stride(0), q.stride(1), gate.stride(0), out.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        PAGE=page, GROUP=num_heads // num_kv_heads, D=head_dim, M_ROWS=cfg["M_ROWS"], BLOCK_N=cfg["BLOCK_N"],
        DOT=dot_mode(q.dtype), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl())


def decode_attention(q, k_cache, v_cache, gate, out, block_tables, context_lens, cu_seqlens, dec_seqs,
                     scale: float, max_q_len: int, splits_per_seq: int, chunks: int | None = None) -> None:
    """Gated attention for decode/verify sequences ``dec_seqs`` (each at most
    ``tokens_per_tile`` query tokens): chunk partials, then the ordered merge. ``chunks``: at
    least the KV_SPLIT chunks the sequences' contexts span together (default: every sequence
    at its block table's full width)."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    num_dec = dec_seqs.shape[0]
    if num_dec == 0:
        return
    decode_tokens = triton.next_power_of_2(max(max_q_len, 1))
    rows = decode_rows(max_q_len, group)  # MMA rows: decode rows waste less of a small tile
    assert rows <= M_ROWS
    if chunks is None:
        chunks = num_dec * triton.cdiv(block_tables.shape[1] * page, KV_SPLIT)
    slots = workspace_slots(num_dec * decode_tokens, chunks, decode_tokens)
    ws_acc = torch.empty((slots, num_heads, head_dim), dtype=torch.float32, device=q.device)
    ws_m = torch.empty((slots, num_heads), dtype=torch.float32, device=q.device)
    ws_l = torch.empty_like(ws_m)
    block_b = PREFIX_BLOCK  # fixed: a batch-dependent constexpr would compile a variant per batch size
    _decode_split_kernel[(num_kv_heads, splits_per_seq, num_dec)](
        q, k_cache, v_cache, ws_acc, ws_m, ws_l, block_tables, context_lens, cu_seqlens, dec_seqs,
        scale * LOG2E, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), num_heads, PAGE=page, GROUP=group, D=head_dim, M_ROWS=rows, BLOCK_N=BLOCK_N,
        KV_SPLIT=KV_SPLIT, DECODE_TOKENS=decode_tokens, BLOCK_B=block_b, DOT=dot_mode(q.dtype),
        Q_F16=FP8_KV_F16 and k_cache.dtype == torch.float8_e4m3fn and q.dtype == torch.bfloat16,
        num_warps=DECODE_WARPS, num_stages=DECODE_STAGES, **pdl())
    # loads in flight: up to 32 x 16 (sequence, head) programs they pay (most at long contexts and
    # small batch); more programs already hide the latency and lose occupancy (benchmarks sections 14, 15)
    stages = MERGE_STAGES if num_dec * num_heads <= MERGE_PIPELINED_PROGRAMS else 1
    run = MERGE_RUN
    runs = triton.cdiv(triton.cdiv(block_tables.shape[1] * page, KV_SPLIT), run)
    if runs > 1:  # some row may have more than ``run`` chunks (its block table is that wide)
        per_head = max(1, min(runs, triton.cdiv(RUN_PROGRAMS, num_dec * num_heads)))
        _merge_runs_kernel[(num_dec, num_heads, per_head)](
            ws_acc, ws_m, ws_l, context_lens, cu_seqlens, dec_seqs, num_heads, D=head_dim, KV_SPLIT=KV_SPLIT,
            DECODE_TOKENS=decode_tokens, BLOCK_B=block_b, RUN=run, STAGES=RUN_STAGES, num_warps=MERGE_WARPS,
            **pdl())
    _merge_kernel[(num_dec, num_heads)](
        ws_acc, ws_m, ws_l, gate, out, context_lens, cu_seqlens, dec_seqs, gate.stride(0), out.stride(0), num_heads,
        D=head_dim, KV_SPLIT=KV_SPLIT, DECODE_TOKENS=decode_tokens, BLOCK_B=block_b, RUN=run, STAGES=stages,
        num_warps=MERGE_WARPS, **pdl())
