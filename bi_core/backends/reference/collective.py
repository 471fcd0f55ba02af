"""Collectives of the reference backend: the library's (gloo on CPUs, NCCL on GPUs)."""

from __future__ import annotations

from bi_core.ops.collective import (
    AllGatherBuilder,
    AllReduceBuilder,
    CollectiveSpec,
    LastDimAllGather,
    LibraryAllReduce,
    distributed_reasons,
)


class ReferenceAllReduceBuilder(AllReduceBuilder):
    def check(self, spec: CollectiveSpec, policy) -> list[str]:
        return distributed_reasons()

    def build(self, spec: CollectiveSpec) -> LibraryAllReduce:
        return LibraryAllReduce(spec)


class ReferenceAllGatherBuilder(AllGatherBuilder):
    def check(self, spec: CollectiveSpec, policy) -> list[str]:
        return distributed_reasons()

    def build(self, spec: CollectiveSpec) -> LastDimAllGather:
        return LastDimAllGather(spec)
