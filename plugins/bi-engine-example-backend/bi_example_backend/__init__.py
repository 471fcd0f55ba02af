"""Example third-party backend: RMSNorm through torch.nn.functional.rms_norm (one op only)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bi_core import hookimpl
from bi_core.ops.norm import NormBuilder, NormSpec
from bi_core.registry import Backend


class TorchRMSNormImpl:
    """Zero-centred RMSNorm: ``rms_norm(x) * (1 + w)`` computed in float32, cast back."""

    def __init__(self, eps: float) -> None:
        self.eps = eps

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x.float(), (x.shape[-1],), weight=1.0 + weight.float(), eps=self.eps)
        return y.to(x.dtype)

    def forward_add(self, x, residual, weight):
        r = x + residual
        return self.forward(r, weight), r


class TorchNormBuilder(NormBuilder):
    def check(self, spec: NormSpec, policy) -> list[str]:
        if not hasattr(F, "rms_norm"):
            return ["torch.nn.functional.rms_norm needs torch >= 2.4"]
        return []

    def build(self, spec: NormSpec) -> TorchRMSNormImpl:
        return TorchRMSNormImpl(spec.eps)


@hookimpl
def bi_register_backends(register) -> None:
    register(Backend(name="example_norm", description="RMSNorm via torch.nn.functional.rms_norm",
                     builders=(TorchNormBuilder(),)))
