from __future__ import annotations

import torch
import torch.nn.functional as F

from bi_core.backends.reference.common import check_dtype
from bi_core.ops.norm import NormBuilder, NormSpec


class ReferenceRMSNormImpl:
    """Zero-centred: the stored weight is ``scale - 1``; HF multiplies in fp32, then casts."""

    def __init__(self, eps: float) -> None:
        self.eps = eps

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + weight.float())).to(x.dtype)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor):
        r = x + residual
        return self.forward(r, weight), r


class ReferenceGatedRMSNormImpl:
    """HF order: normalise in fp32, cast, times weight (model dtype), times silu(gate) in fp32, cast."""

    def __init__(self, eps: float) -> None:
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        y = weight.to(x.dtype) * y
        return (y * F.silu(gate.float())).to(x.dtype)


class ReferenceNormBuilder(NormBuilder):
    def check(self, spec: NormSpec, policy) -> list[str]:
        return check_dtype(spec)

    def build(self, spec: NormSpec):
        if spec.kind == "rms_gated":
            return ReferenceGatedRMSNormImpl(spec.eps)
        return ReferenceRMSNormImpl(spec.eps)
