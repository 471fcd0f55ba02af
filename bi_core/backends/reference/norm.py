from __future__ import annotations

import torch
import torch.nn.functional as F

from bi_core.backends.reference.dtypes import check_dtype
from bi_core.ops.activation import Fp8Activation
from bi_core.ops.norm import NormBuilder, NormSpec
from bi_core.quant.fp8_numerics import quantize_activations


def rms_norm_1p(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred: the stored weight is ``scale - 1``; transformers multiplies in fp32, then casts."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The GDN output norm, transformers' order: normalise in fp32, cast, times weight (model
    dtype), times silu(gate) in fp32, cast."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    y = weight.to(x.dtype) * y
    return (y * F.silu(gate.float())).to(x.dtype)


class ReferenceRMSNormImpl:
    """With ``fp8_group`` the output comes with its block-FP8 copy (``quant/fp8_numerics.py``'s quantizer)."""

    def __init__(self, eps: float, fp8_group: int | None = None) -> None:
        self.eps, self.fp8_group = eps, fp8_group

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | Fp8Activation:
        y = rms_norm_1p(x, weight, self.eps)
        return y if self.fp8_group is None else Fp8Activation(y, *quantize_activations(y, self.fp8_group))

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor):
        r = x + residual
        return self.forward(r, weight), r


class ReferenceNormBuilder(NormBuilder):
    fp8_output = True

    def check(self, spec: NormSpec, policy) -> list[str]:
        return check_dtype(spec)

    def build(self, spec: NormSpec) -> ReferenceRMSNormImpl:
        return ReferenceRMSNormImpl(spec.eps, spec.fp8_group)
