"""cuda_grouped_mm: one op only (MoE experts through ``torch._grouped_mm``), to be chosen per op
from YAML (``policy.ops.moe: [cuda_grouped_mm, cuda_default]``) and measured against the Triton
fused-MoE kernel of cuda_default. It registers like any third-party backend."""

from __future__ import annotations

import torch

from bi_core.backends.cuda_common.reasons import cuda_reasons
from bi_core.hookspecs import hookimpl
from bi_core.ops import MoEBuilder
from bi_core.registry import Backend


class GroupedMMMoEBuilder(MoEBuilder):
    def check(self, spec, policy):
        reasons = cuda_reasons(spec, hopper=True, modules=("triton",))
        if not hasattr(torch, "_grouped_mm"):
            reasons.append(f"torch {torch.__version__} has no torch._grouped_mm")
        if spec.hidden_size % 16 or spec.intermediate_size % 16:
            reasons.append("grouped_mm needs hidden and intermediate sizes that are multiples of 16")
        return reasons

    def build(self, spec):
        from bi_core.backends.cuda_common.kernel_calls import GroupedMMMoEImpl

        return GroupedMMMoEImpl()


@hookimpl
def bi_register_backends(register) -> None:
    register(Backend(name="cuda_grouped_mm", description="MoE experts via torch._grouped_mm (one op)",
                     builders=(GroupedMMMoEBuilder(),)))
