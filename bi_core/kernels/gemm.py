"""``C = A @ W.T`` with a K reduction order fixed by (N, K) alone: a sequential K loop of fixed
BLOCK_K, fp32 accumulation, no split-K. BLOCK_M may follow M for speed (the per-row arithmetic
does not depend on it; tests/gpu check this bitwise), BLOCK_N/BLOCK_K follow (N, K) only."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bi_core.kernels.common import dot_mode, mma


@triton.jit
def _gemm_kernel(A, B, C, M, N, K, stride_am, stride_bn, stride_cm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptr = A + rm[:, None].to(tl.int64) * stride_am + rk[None, :]
    b_ptr = B + rn[None, :].to(tl.int64) * stride_bn + rk[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptr, mask=(rm[:, None] < M) & (rk[None, :] + k0 < K), other=0.0)
        b = tl.load(b_ptr, mask=(rn[None, :] < N) & (rk[:, None] + k0 < K), other=0.0)
        acc = mma(a, b, acc, DOT)
        a_ptr += BLOCK_K
        b_ptr += BLOCK_K
    c_ptr = C + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
    tl.store(c_ptr, acc.to(C.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


BLOCK_K = 64  # the K reduction order: fixed for every shape and batch
TARGET_PROGRAMS = 264  # about two programs per SM keep a memory-bound GEMV near bandwidth


def block_m_for(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128


def gemm_config(m: int, n: int) -> dict:
    """BLOCK_M and BLOCK_N follow the shape for speed (small N gets narrow tiles so a decode GEMV
    still spreads over the SMs); neither changes a row's K order, which BLOCK_K alone fixes."""
    bm = block_m_for(m)
    bn = 128
    while bn > 16 and triton.cdiv(m, bm) * triton.cdiv(n, bn) < TARGET_PROGRAMS:
        bn //= 2
    bn = min(bn, max(16, triton.next_power_of_2(n)))
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": BLOCK_K, "num_stages": 4 if bm <= 32 else 3}


def linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ weight[N, K].T``; fp32 operands use IEEE dots (no TF32)."""
    shape = x.shape
    a = x.reshape(-1, shape[-1])
    if a.stride(-1) != 1:
        a = a.contiguous()
    m, k = a.shape
    n = weight.shape[0]
    assert weight.stride(-1) == 1 and weight.shape[1] == k
    c = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    if m == 0:
        return c.view(*shape[:-1], n)
    cfg = gemm_config(m, n)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _gemm_kernel[grid](a, weight, c, m, n, k, a.stride(0), weight.stride(0), c.stride(0), GROUP_M=8,
                       DOT=dot_mode(x.dtype), num_warps=4, **cfg)
    return c.view(*shape[:-1], n)
