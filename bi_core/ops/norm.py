"""Zero-centred RMSNorm ``x̂ (1 + w)`` with optional fused residual add (every decoder norm; the
GDN gated norm belongs to the gdn op, q/k norms to attention)."""

from __future__ import annotations

from typing import Protocol

import attrs
import torch

from bi_core.ops.base import OpBuilder, OpSpec


@attrs.frozen(kw_only=True)
class NormSpec(OpSpec):
    hidden_size: int
    eps: float


class RMSNormImpl(Protocol):
    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Zero-centred RMSNorm over the last dim."""

    def forward_add(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``r = x + residual`` (in the activation dtype), returns ``(norm(r), r)``."""


class NormBuilder(OpBuilder[NormSpec]):
    op = "norm"
