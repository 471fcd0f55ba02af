"""``C = A @ W.T`` with a K reduction order fixed by (N, K) alone.

K is cut into ``SPLIT_K`` equal ranges (the split count is chosen from (N, K), never from M);
each range is a sequential loop of fixed ``BLOCK_K`` steps with fp32 accumulation, and the
partial sums are added in split order 0, 1, ... by whichever program of the tile finishes last
(a per-tile arrival counter says which; the counter orders nothing arithmetic, it only elects
the program that does the fixed-order sum). So a row's bits never depend on how many rows the
call has. BLOCK_M / BLOCK_N / warps / stages follow M for speed: they change which program
computes an element, not the element's reduction order (checked bitwise on the GPU for
M = 1..1024, tests/gpu). One launch per GEMM, split or not: decode GEMVs get enough programs
to reach bandwidth without a second reduction kernel."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bi_core.kernels.common import INTERPRET, dot_mode, mma, pdl, pdl_start

TARGET_PROGRAMS = 264  # about two programs per SM of an H100/H200 (132 SMs) at decode
DECODE_BLOCK_N = 32  # the tile width a decode GEMV uses; split counts are planned against it
MIN_SPLIT_K = 256  # no split range shorter than this many K elements
MID_M_MAX = 256  # rows up to which gemm_config uses the large-decode-batch tiles
MID_MIN_TILES = 200  # fewer 64 x 128 tiles than this: 64 x 64 (gemm_sweep.py mid, benchmarks section 12)
# from this many rows a 16-bit GEMM with N >= TMA_MIN_N loads its tiles by TMA on SM90
# (``_gemm_tma_kernel``; narrower GEMMs, the router's 257 columns, are faster as they were)
TMA_MIN_M, TMA_MIN_N = 512, 1024
MAX_LOCKS = 1 << 16  # per-tile arrival counters (tiles of a split GEMM, any M up to 65536 rows)

_locks: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _epilogue(acc, acc_up, dt: tl.constexpr, SILU_MUL: tl.constexpr):
    """The output tile: the GEMM result, or silu(gate) * up rounded like separate ops (each GEMM
    output, silu(gate), the product)."""
    if SILU_MUL:
        gate = acc.to(dt).to(tl.float32)
        return ((gate * tl.sigmoid(gate)).to(dt).to(tl.float32) * acc_up.to(dt).to(tl.float32)).to(dt)
    return acc.to(dt)


@triton.jit
def _k_range(a_ptr, b_ptr, up_ptr, rm, rn, rk, M, N, k_lo, k_hi, k_steps, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SILU_MUL: tl.constexpr, DOT: tl.constexpr):
    """One split: fp32 sums over K in [k_lo, k_hi), ``k_steps`` fixed BLOCK_K steps in order
    (pointers at k_lo). The trip count does not depend on the split, so an INLINE loop over the
    splits can be flattened into one pipelined loop (Triton fuses only such loop nests)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in range(0, k_steps):
        k_ok = rk + (k_lo + j * BLOCK_K) < k_hi
        a = tl.load(a_ptr, mask=(rm[:, None] < M) & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr, mask=(rn[None, :] < N) & k_ok[:, None], other=0.0)
        acc = mma(a, b, acc, DOT)
        if SILU_MUL:
            acc_up = mma(a, tl.load(up_ptr, mask=(rn[None, :] < N) & k_ok[:, None], other=0.0), acc_up, DOT)
            up_ptr += BLOCK_K
        a_ptr += BLOCK_K
        b_ptr += BLOCK_K
    return acc, acc_up


@triton.jit
def _tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program ``pid``: GROUP_M row tiles sweep each column tile in
    turn, so neighbouring programs share weight tiles in L2."""
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    return first_m + (pid % (GROUP_M * num_n)) % size_m, (pid % (GROUP_M * num_n)) // size_m


@triton.jit(do_not_specialize=["M"])  # M changes every step: no compiled variant per M % 16
def _gemm_kernel(A, B, C, WS, LOCKS, M, N, K, K_PER_SPLIT, stride_am, stride_bn, stride_cm,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                 INLINE: tl.constexpr, SILU_MUL: tl.constexpr, GROUP_M: tl.constexpr, DOT: tl.constexpr,
                 PDL: tl.constexpr, pdl_early):
    pdl_start(PDL, pdl_early)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    pid_m, pid_n = _tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptr = A + rm[:, None].to(tl.int64) * stride_am + rk[None, :]
    b_ptr = B + rn[None, :].to(tl.int64) * stride_bn + rk[:, None]
    up_off = N * stride_bn  # SILU_MUL: weight rows [N, 2N) are the up projection
    c_mask = (rm[:, None] < M) & (rn[None, :] < N)
    c_ptr = C + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
    dt = C.dtype.element_ty
    # every split runs the same number of BLOCK_K steps (K_PER_SPLIT is a multiple of BLOCK_K; a
    # split's steps past K load zeros and are masked, as the split GEMM's K range guarantees)
    k_steps = tl.cdiv(tl.minimum(K, K_PER_SPLIT), BLOCK_K)
    if INLINE:  # one program does every split, and adds them in split order: the same sums, no workspace
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        total_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # flattened: the splits' K loops become one pipelined loop, not a pipeline refilled per split
        # (faster at every row count swept: gemm_sweep.py inline, benchmarks section 13, change 2)
        for s in tl.range(0, SPLIT_K, flatten=True):
            k_lo = s * K_PER_SPLIT
            acc, acc_up = _k_range(a_ptr + k_lo, b_ptr + k_lo, b_ptr + up_off + k_lo, rm, rn, rk, M, N, k_lo,
                                   tl.minimum(K, k_lo + K_PER_SPLIT), k_steps, BLOCK_M, BLOCK_N, BLOCK_K, SILU_MUL, DOT)
            total = tl.where(s == 0, acc, total + acc)  # split 0 as is (a -0.0 stays -0.0, as in the fix-up)
            total_up = tl.where(s == 0, acc_up, total_up + acc_up)
        tl.store(c_ptr, _epilogue(total, total_up, dt, SILU_MUL), mask=c_mask)
    else:  # a constexpr branch: the INLINE variant never compiles the workspace code (LOCKS may be C then)
        k_lo = split * K_PER_SPLIT
        acc, acc_up = _k_range(a_ptr + k_lo, b_ptr + k_lo, b_ptr + up_off + k_lo, rm, rn, rk, M, N, k_lo,
                               tl.minimum(K, k_lo + K_PER_SPLIT), k_steps, BLOCK_M, BLOCK_N, BLOCK_K, SILU_MUL, DOT)
        if SPLIT_K == 1:
            tl.store(c_ptr, _epilogue(acc, acc_up, dt, SILU_MUL), mask=c_mask)
        else:
            halves: tl.constexpr = 2 if SILU_MUL else 1
            tile_elems = rm[:, None].to(tl.int64) * (halves * N) + rn[None, :]
            part = WS + split * M * (halves * N) + tile_elems
            tl.store(part, acc, mask=c_mask)
            if SILU_MUL:
                tl.store(part + N, acc_up, mask=c_mask)
            tl.debug_barrier()  # every thread's partial is written before the arrival is counted
            arrived = tl.atomic_add(LOCKS + pid, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:  # last program of this tile: sum the partials in split order
                total = tl.load(WS + tile_elems, mask=c_mask, other=0.0, cache_modifier=".cg")
                total_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                if SILU_MUL:
                    total_up = tl.load(WS + tile_elems + N, mask=c_mask, other=0.0, cache_modifier=".cg")
                for s in range(1, SPLIT_K):
                    part = WS + s * M * (halves * N) + tile_elems
                    total += tl.load(part, mask=c_mask, other=0.0, cache_modifier=".cg")
                    if SILU_MUL:
                        total_up += tl.load(part + N, mask=c_mask, other=0.0, cache_modifier=".cg")
                tl.store(c_ptr, _epilogue(total, total_up, dt, SILU_MUL), mask=c_mask)
                tl.atomic_xchg(LOCKS + pid, 0)  # leave the counter at zero for the next call (and graph replays)


@triton.jit
def _k_range_tma(a_desc, b_desc, om, on, up_row, k_lo, k_steps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SILU_MUL: tl.constexpr, DOT: tl.constexpr):
    """``_k_range`` with its tiles loaded by TMA: the same ``k_steps`` BLOCK_K steps from k_lo, in
    order. A tile past the matrix's K (or its rows) reads zeros, as the masked loads do; a split
    never reads the next split's K (its length is a multiple of BLOCK_K)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in range(0, k_steps):
        k = k_lo + j * BLOCK_K
        a = a_desc.load([om, k])
        acc = mma(a, b_desc.load([on, k]).T, acc, DOT)
        if SILU_MUL:  # weight rows [N, 2N): the up projection
            acc_up = mma(a, b_desc.load([up_row + on, k]).T, acc_up, DOT)
    return acc, acc_up


@triton.jit(do_not_specialize=["M"])
def _gemm_tma_kernel(a_desc, b_desc, C, M, N, K, K_PER_SPLIT, stride_cm, NUM_PROGRAMS, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, SILU_MUL: tl.constexpr,
                     GROUP_M: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr, FLATTEN: tl.constexpr, pdl_early):
    """``_gemm_kernel``'s INLINE form (one program sums its tile's splits in split order) for
    prefill-sized M on SM90: tiles come by TMA, and ``NUM_PROGRAMS`` programs loop over the tiles
    (persistent when there are fewer programs than tiles; FLATTEN fuses the tile and K loops of an
    unsplit GEMM into one pipeline). The K order is ``_gemm_kernel``'s, so every bit is too."""
    pdl_start(PDL, pdl_early)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(tl.minimum(K, K_PER_SPLIT), BLOCK_K)
    dt = C.dtype.element_ty
    for t in tl.range(tl.program_id(0), num_m * num_n, NUM_PROGRAMS, flatten=FLATTEN):
        pid_m, pid_n = _tile(t, num_m, num_n, GROUP_M)
        om = pid_m * BLOCK_M
        on = pid_n * BLOCK_N
        if SPLIT_K == 1:
            total, total_up = _k_range_tma(a_desc, b_desc, om, on, N, 0, k_steps, BLOCK_M, BLOCK_N, BLOCK_K,
                                           SILU_MUL, DOT)
        else:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            total_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.range(0, SPLIT_K, flatten=True):
                acc, acc_up = _k_range_tma(a_desc, b_desc, om, on, N, s * K_PER_SPLIT, k_steps, BLOCK_M, BLOCK_N,
                                           BLOCK_K, SILU_MUL, DOT)
                total = tl.where(s == 0, acc, total + acc)  # split 0 as is, as in _gemm_kernel
                total_up = tl.where(s == 0, acc_up, total_up + acc_up)
        rm = om + tl.arange(0, BLOCK_M)
        rn = on + tl.arange(0, BLOCK_N)
        tl.store(C + rm[:, None].to(tl.int64) * stride_cm + rn[None, :], _epilogue(total, total_up, dt, SILU_MUL),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))


def block_m_for(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128


def block_k_for(n: int, k: int) -> int:
    """Part of the K order: fixed by (N, K). 64, or 128 for vocabulary-sized heads (the best at M=1
    in benchmarks/kernel_bench.py --sweep: benchmarks section 5)."""
    return 128 if n >= 65536 and k >= 1024 else 64


def split_k_for(n: int, k: int) -> int:
    """Part of the K order: fixed by (N, K). Enough splits that a one-row GEMM fills about
    TARGET_PROGRAMS programs, each split at least MIN_SPLIT_K long and a multiple of BLOCK_K."""
    tiles, bk, split = triton.cdiv(n, DECODE_BLOCK_N), block_k_for(n, k), 1
    while tiles * split < TARGET_PROGRAMS and k // (2 * split) >= MIN_SPLIT_K and k % (2 * split * bk) == 0:
        split *= 2
    return split


def gemm_config(m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16, silu_mul: bool = False) -> dict:
    """BLOCK_K and SPLIT_K fix the K order from (N, K); the rest follows M for speed (decode tiles
    from the M=1 sweep; wider tiles for more rows, narrowed until about TARGET_PROGRAMS programs).
    With enough full-width tiles to fill the GPU, a split GEMM runs INLINE: each program adds its
    tile's splits itself, in split order (the same sums, no fp32 workspace round trip)."""
    bm, split = block_m_for(m), split_k_for(n, k)
    # a large decode batch through a hidden-sized GEMM (not the lm_head): 64-row tiles, 4 warps,
    # and a split GEMM with enough tiles adds its splits in-program (gemm_sweep.py mid, benchmarks section 12)
    mid = 64 < m <= MID_M_MAX and n < 65536
    if mid:
        bm = 64
        inline = split > 1 and m > 128 and triton.cdiv(m, 64) * triton.cdiv(n, 64) >= 64
    else:  # past the decode batches a wide split GEMM adds its splits in-program (gemm_sweep.py inline,
        # N=2048: benchmarks section 13)
        wide = m > MID_M_MAX and n >= 1024
        inline = split > 1 and bm > 16 and (wide or triton.cdiv(m, bm) * triton.cdiv(n, 128) >= TARGET_PROGRAMS // 2)
    programs_per_tile = 1 if inline else split
    if bm <= 16:
        bn, warps, stages = (16 if n <= 1024 else DECODE_BLOCK_N if n <= 16384 else 64), 2, 4
    elif mid:  # split GEMMs 64 wide; the others 128 wide unless that leaves under ~1.5 tiles per SM
        bn, warps, stages = (64 if split > 1 else 128), 4, 3
        while split == 1 and bn > 64 and triton.cdiv(m, bm) * triton.cdiv(n, bn) < MID_MIN_TILES:
            bn //= 2
    elif inline and wide:  # 128 x 64 tiles up to 512 rows, then 128 x 128
        bn, warps, stages = (64 if m <= 2 * MID_M_MAX else 128), 8, 3
    else:
        bn, warps, stages = 128, (8 if bm == 128 else 4), (3 if bm >= 64 else 4)
        while bn > 32 and triton.cdiv(m, bm) * triton.cdiv(n, bn) * programs_per_tile < TARGET_PROGRAMS:
            bn //= 2
    if dtype == torch.float32:
        stages = 2  # fp32 tiles are twice the bytes: three stages of 128x128 tiles overflow shared memory
    tma = dtype != torch.float32 and m >= TMA_MIN_M and n >= TMA_MIN_N
    if tma:  # prefill: TMA tiles, splits inline; the fastest per kind (gemm_sweep.py tma, benchmarks section 23)
        bm, warps, inline = 128, 8, True
        if silu_mul or block_k_for(n, k) == 128:  # two weight tiles a step, or 128-wide K: 3 stages fit
            bn, stages = 128, 3
        else:
            bn, stages = (256, 3) if split == 1 else (128, 4)
    bn = min(bn, max(16, triton.next_power_of_2(n)))
    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": block_k_for(n, k), "SPLIT_K": split, "INLINE": inline,
           "num_warps": warps, "num_stages": stages}
    if tma:  # persistent (programs loop over tiles) except the SiLU-and-mul GEMM, slower so
        cfg.update(TMA=True, PERSISTENT=not silu_mul)
    return cfg


def tile_locks(device: torch.device) -> torch.Tensor:
    if device not in _locks:  # zeroed once; every split GEMM leaves its counters at zero
        _locks[device] = torch.zeros(MAX_LOCKS, dtype=torch.int32, device=device)
    return _locks[device]


def linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None, config: dict | None = None,
           silu_mul: bool = False) -> torch.Tensor:
    """``x [..., K] @ weight[N, K].T``; fp32 operands use IEEE dots (no TF32). With ``silu_mul``
    the weight is ``[gate; up]`` (2N rows) and the result ``silu(x @ gate.T) * (x @ up.T)``.
    ``config`` overrides the tile table (benchmarks only: a different BLOCK_K or SPLIT_K is a
    different K order)."""
    shape = x.shape
    a = x.reshape(-1, shape[-1])
    if a.stride(-1) != 1:
        a = a.contiguous()
    m, k = a.shape
    n = weight.shape[0] // (2 if silu_mul else 1)
    assert weight.stride(-1) == 1 and weight.shape[1] == k
    c = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    if m == 0:
        return c.view(*shape[:-1], n)
    cfg = {"INLINE": False, **(config or gemm_config(m, n, k, x.dtype, silu_mul))}
    persistent = cfg.pop("PERSISTENT", False)
    if cfg.pop("TMA", False) and _tma_ready(a, weight):
        return _linear_tma(a, weight, c, cfg, persistent, silu_mul).view(*shape[:-1], n)
    split = cfg.pop("SPLIT_K")
    tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    if split > 1 and not cfg["INLINE"] and tiles > MAX_LOCKS:
        raise ValueError(f"split-K GEMM with {tiles} tiles (M={m}, N={n}): more than {MAX_LOCKS} counters")
    k_per_split = triton.cdiv(triton.cdiv(k, split), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    halves = 2 if silu_mul else 1
    grid_split = 1 if cfg["INLINE"] else split
    ws = torch.empty((split, m, halves * n), dtype=torch.float32, device=x.device) if grid_split > 1 else c
    locks = tile_locks(x.device) if grid_split > 1 else c
    _gemm_kernel[(tiles, grid_split)](a, weight, c, ws, locks, m, n, k, k_per_split, a.stride(0), weight.stride(0),
                                 c.stride(0), SPLIT_K=split, SILU_MUL=silu_mul, GROUP_M=8, DOT=dot_mode(x.dtype),
                                 **cfg, **pdl())
    return c.view(*shape[:-1], n)


_sms: dict[torch.device, int] = {}


def _tma_ready(a: torch.Tensor, weight: torch.Tensor) -> bool:
    """TMA needs SM90 (or Triton's interpreter, which emulates it), 16-byte aligned bases and row
    strides; a GEMM without them runs ``_gemm_kernel`` with the same tiles (the same bits)."""
    if not (INTERPRET or (a.is_cuda and torch.cuda.get_device_capability(a.device)[0] >= 9)):
        return False
    return all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 for t in (a, weight))


def _linear_tma(a: torch.Tensor, weight: torch.Tensor, c: torch.Tensor, cfg: dict, persistent: bool,
                silu_mul: bool) -> torch.Tensor:
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = a.shape
    n = c.shape[1]
    bm, bn, bk, split = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    programs = tiles
    if persistent and a.is_cuda:
        if a.device not in _sms:
            _sms[a.device] = torch.cuda.get_device_properties(a.device).multi_processor_count
        programs = min(tiles, _sms[a.device])
    k_per_split = triton.cdiv(triton.cdiv(k, split), bk) * bk
    _gemm_tma_kernel[(programs,)](
        TensorDescriptor.from_tensor(a, [bm, bk]), TensorDescriptor.from_tensor(weight, [bn, bk]), c, m, n, k,
        k_per_split, c.stride(0), programs, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, SILU_MUL=silu_mul,
        GROUP_M=8, DOT=dot_mode(a.dtype), FLATTEN=persistent and split == 1, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **pdl())
    return c
