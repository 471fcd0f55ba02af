from __future__ import annotations

import torch
import torch.nn.functional as F

from bi_core.backends.reference.common import check_dtype
from bi_core.ops.linear import LinearBuilder, LinearSpec


class ReferenceLinearImpl:
    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)


class ReferenceLinearBuilder(LinearBuilder):
    def check(self, spec: LinearSpec, policy) -> list[str]:
        return check_dtype(spec)

    def build(self, spec: LinearSpec) -> ReferenceLinearImpl:
        return ReferenceLinearImpl()
