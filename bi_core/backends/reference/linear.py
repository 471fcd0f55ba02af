from __future__ import annotations

import torch
import torch.nn.functional as F

from bi_core.backends.reference.common import check_dtype
from bi_core.ops.linear import LinearBuilder, LinearSpec


def silu_and_mul(y: torch.Tensor) -> torch.Tensor:
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


class ReferenceLinearImpl:
    def __init__(self, silu_mul: bool = False) -> None:
        self.silu_mul = silu_mul

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, weight)
        return silu_and_mul(y) if self.silu_mul else y


class ReferenceLinearBuilder(LinearBuilder):
    def check(self, spec: LinearSpec, policy) -> list[str]:
        return check_dtype(spec)

    def build(self, spec: LinearSpec) -> ReferenceLinearImpl:
        return ReferenceLinearImpl(spec.silu_mul)
