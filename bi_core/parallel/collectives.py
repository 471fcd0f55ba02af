"""Collective algorithms on torch.distributed (NCCL on GPUs, gloo on CPUs).

``all_reduce_fixed_order`` is the batch-invariant sum: every element is summed in rank order
(r0 + r1 + ... + r(N-1), in float32, rounded once), whatever the message size. It is a
reduce-scatter with a fixed chunk-to-rank map (all-to-all: rank r receives chunk r of every rank),
a local fixed-order sum, and an all-gather of the summed chunks: the same bytes on the wire as a
ring all-reduce (2(N-1)/N of the message per rank). A library all-reduce instead picks its
algorithm, chunking and protocol by message size, so the partial sums an element goes through,
and with more than two ranks their association, change with the number of rows in the step. With
two ranks there is one addition per element, a + b, and IEEE addition commutes: any algorithm
gives the same bits (docs/scale-out.md)."""

from __future__ import annotations

import torch
import torch.distributed as dist

_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """The library's all-reduce (NCCL / gloo), in place."""
    dist.all_reduce(x, group=group)
    return x


def all_reduce_fixed_order(x: torch.Tensor, group, world: int) -> torch.Tensor:
    """Sum of ``x`` over the ranks, each element in rank order; returns a new tensor."""
    flat = x.reshape(-1)
    n = flat.numel()
    chunk = -(-n // world)
    if chunk * world != n:
        flat = torch.cat([flat, flat.new_zeros(chunk * world - n)])
    parts = torch.empty_like(flat)
    dist.all_to_all_single(parts, flat, group=group)  # parts[r*chunk:(r+1)*chunk] = rank r's copy of my chunk
    parts = parts.view(world, chunk)
    acc = parts[0].float()
    for r in range(1, world):
        acc = acc + parts[r].float()
    out = torch.empty_like(flat)
    _gather(out, acc.to(x.dtype), group=group)
    return out[:n].view_as(x)


def all_gather_last_dim(x: torch.Tensor, group, world: int) -> torch.Tensor:
    """``[..., n]`` on each rank -> ``[..., world * n]``, rank r's columns at ``[r*n, (r+1)*n)``."""
    x = x.contiguous()
    out = torch.empty((world, *x.shape), dtype=x.dtype, device=x.device)
    _gather(out.view(-1), x.view(-1), group=group)
    return out.movedim(0, -2).reshape(*x.shape[:-1], world * x.shape[-1])
