"""Per-row LoRA (``bi_core/ops/lora.py``): one gather mat-vec kernel for both products, the shrink
``h[t] = x[t] @ A[s].T`` and the expand ``y[t] += h[t] @ B[s].T`` (``s = slots[t]``, ``-1``: none).
One program per (row, block of outputs): the row's adapter weights gathered by its slot, products
summed in float32 over K blocks in ascending order, then across the block by one ``tl.sum``; the
block sizes depend on K and N only, never on the number of rows, so a row's bits depend on that row
alone whatever else shares the batch (batch-invariant by construction)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lora_rows_kernel(X, W, SLOTS, Y, RANKS, K, N, PART, stride_x, stride_ws, stride_wn, stride_y, ADD: tl.constexpr,
                      RANKED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(SLOTS + t)
    if slot < 0:  # a row without an adapter reads nothing: the shrink writes its zeros, the expand nothing
        if not ADD:
            tl.store(Y + t * stride_y + cols, tl.zeros((BLOCK_N,), dtype=Y.dtype.element_ty), mask=cols < N)
        return
    safe = slot.to(tl.int64)
    base = W + safe * stride_ws
    ks = tl.arange(0, BLOCK_K)
    # RANKED 1 (the shrink: W = A, its rows are R) / 2 (the expand: W = B, its K is R): the slot's
    # rank columns of each PART-wide part only; the rest are zeros, so skipping them changes no bit
    col_ok = cols[:, None] < N
    rank = PART
    if RANKED != 0:
        rank = tl.load(RANKS + safe)
    if RANKED == 1:
        col_ok = col_ok & ((cols[:, None] % PART) < rank)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < K
        if RANKED == 2:
            k_ok = k_ok & ((kk % PART) < rank)
        x = tl.load(X + t * stride_x + kk, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(base + cols[:, None].to(tl.int64) * stride_wn + kk[None, :], mask=col_ok & k_ok[None, :],
                    other=0.0).to(tl.float32)
        acc += w * x[None, :]
    delta = tl.sum(acc, axis=1).to(Y.dtype.element_ty)
    out = Y + t * stride_y + cols
    if ADD:  # y + delta in the activation dtype (one rounding of the float32 sum, as torch adds)
        y = tl.load(out, mask=cols < N, other=0.0)
        tl.store(out, (y.to(tl.float32) + delta.to(tl.float32)).to(Y.dtype.element_ty), mask=cols < N)
    else:  # the shrink
        tl.store(out, delta, mask=cols < N)


def _blocks(k: int, n: int) -> tuple[int, int]:
    return min(64, triton.next_power_of_2(n)), min(128, triton.next_power_of_2(k))


def lora_rows(x: torch.Tensor, w: torch.Tensor, slots: torch.Tensor, y: torch.Tensor | None = None,
              ranks: torch.Tensor | None = None, part: int = 0, ranked: int = 0) -> torch.Tensor:
    """``x [T, K]``, ``w [S, N, K]`` -> ``x[t] @ w[slots[t]].T`` ``[T, N]`` in x's dtype (a new
    tensor), or, given ``y [T, N]``, added to ``y`` in place (rows of slot -1 untouched).
    ``ranks`` [S] with ``ranked`` 1 (N is the rank axis) or 2 (K is): only the first ``ranks[s]``
    of every ``part`` indices of that axis are read (the others are zeros)."""
    rows, k = x.shape
    n = w.shape[1]
    add = y is not None
    if y is None:
        y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    assert x.stride(1) == 1 and w.is_contiguous() and y.stride(1) == 1 and slots.shape == (rows,)
    if ranks is None or part <= 0:
        ranks, part, ranked = slots, max(k, n), 0  # (RANKS unread)
    if rows:
        bn, bk = _blocks(k, n)
        _lora_rows_kernel[(rows, triton.cdiv(n, bn))](x, w, slots, y, ranks, k, n, part, x.stride(0), w.stride(0),
                                                       w.stride(1), y.stride(0), ADD=add, RANKED=ranked,
                                                       BLOCK_N=bn, BLOCK_K=bk, num_warps=4)
    return y


def lora_apply(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
               ranks: torch.Tensor | None = None, part: int = 0) -> torch.Tensor:
    """``y[t] += round(x[t] @ a[s].T) @ b[s].T`` for every row with a slot (``ops/lora.py``);
    with ``ranks``, each slot's padding columns are skipped (the same bits, fewer bytes read)."""
    h = lora_rows(x, a, slots, ranks=ranks, part=part, ranked=1)
    return lora_rows(h, b, slots, y, ranks=ranks, part=part, ranked=2)
