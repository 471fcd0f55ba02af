"""Tensor-parallel collectives as ops: ``all_reduce`` (sum of the ranks' partial results, after a
row-parallel projection) and ``all_gather`` (vocabulary-parallel logits). Chosen by the policy
like every other op: the default backends use the library's all-reduce (NCCL / gloo), the
invariant backend a sum whose per-element order is fixed by rank order alone
(``bi_core/parallel/collectives.py``). Impls find their process group in
``bi_core.parallel.state`` (built only when tensor_parallel_size > 1)."""

from __future__ import annotations

from typing import Protocol

import attrs
import torch

from bi_core.ops.base import OpBuilder, OpSpec


@attrs.frozen(kw_only=True)
class CollectiveSpec(OpSpec):
    world_size: int


class CollectiveImpl(Protocol):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """all_reduce: the sum over ranks, same shape; all_gather: ``[..., n]`` -> ``[..., world*n]``."""


class AllReduceBuilder(OpBuilder[CollectiveSpec]):
    op = "all_reduce"


class AllGatherBuilder(OpBuilder[CollectiveSpec]):
    op = "all_gather"


def _group():
    from bi_core.parallel import state

    tp = state.current()
    if tp is None:
        raise RuntimeError("a collective op was built but tensor parallelism is not initialised")
    return tp.device_group


class LibraryAllReduce:
    """The communication library's all-reduce: its algorithm (and sum order) follows the size."""

    def __init__(self, spec: CollectiveSpec) -> None:
        self.group = _group()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from bi_core.parallel.collectives import all_reduce

        return all_reduce(x, self.group)


class FixedOrderAllReduce:
    """Every element summed in rank order, whatever the message size (batch-invariant)."""

    def __init__(self, spec: CollectiveSpec) -> None:
        self.group, self.world = _group(), spec.world_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from bi_core.parallel.collectives import all_reduce_fixed_order

        return all_reduce_fixed_order(x, self.group, self.world)


class PairAllReduce(LibraryAllReduce):
    """Two ranks: the library's all-reduce is batch-invariant. Each element gets one addition,
    r0 + r1, rounded once, and IEEE addition commutes, so every algorithm, chunking and protocol
    gives the same bits (equal to the fixed-order sum whatever the rows: tests/gpu/test_tp_gpu.py,
    dev/benchmarks-history.md). Only with NVLink SHARP (NVLS) off: a reduction inside the switch
    has no documented rounding; ``nvls_off()`` says whether it is."""


def nvls_off() -> bool:
    """NCCL's NVLink SHARP reduction is off (``bi_core.parallel.state.init`` turns it off unless the
    user set ``NCCL_NVLS_ENABLE`` themselves)."""
    import os

    return os.environ.get("NCCL_NVLS_ENABLE", "0") == "0"


class LastDimAllGather:
    """Concatenation over ranks along the last dim: moves bytes, no arithmetic (invariant)."""

    def __init__(self, spec: CollectiveSpec) -> None:
        self.group, self.world = _group(), spec.world_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from bi_core.parallel.collectives import all_gather_last_dim

        return all_gather_last_dim(x, self.group, self.world)


def distributed_reasons() -> list[str]:
    import torch.distributed as dist

    return [] if dist.is_available() else ["torch.distributed is not available in this torch build"]
