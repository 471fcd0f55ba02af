"""RMSNorms: zero-centred ``x̂ (1 + w)`` with optional fused residual add, and the GDN gated norm."""

from __future__ import annotations

from typing import Literal, Protocol

import attrs
import torch

from bi_core.ops.base import OpBuilder, OpSpec


@attrs.frozen(kw_only=True)
class NormSpec(OpSpec):
    hidden_size: int
    eps: float
    kind: Literal["rms_1p", "rms_gated"] = "rms_1p"


class RMSNormImpl(Protocol):
    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Zero-centred RMSNorm over the last dim."""

    def forward_add(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``r = x + residual`` (in the activation dtype), returns ``(norm(r), r)``."""


class GatedRMSNormImpl(Protocol):
    def forward(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``w * rmsnorm(x) * silu(gate)`` over the last dim (plain weight, not zero-centred)."""


class NormBuilder(OpBuilder[NormSpec]):
    op = "norm"
