"""Zero-centred RMSNorm ``x̂ (1 + w)`` with optional fused residual add (every decoder norm; the
GDN gated norm belongs to the gdn op, q/k norms to attention). A norm that feeds block-FP8
projections (``fp8_group``) also writes its output's FP8 copy (``ops/activation.py``)."""

from __future__ import annotations

from typing import ClassVar, Protocol

import attrs
import torch

from bi_core.ops.activation import Fp8Activation
from bi_core.ops.base import OpBuilder, OpSpec, backend_of


@attrs.frozen(kw_only=True)
class NormSpec(OpSpec):
    hidden_size: int
    eps: float
    # the consumers are block-FP8 (W8A8, activations in groups of this many columns): the output
    # comes as an Fp8Activation, its copy bitwise the linear op's own quantization of it
    fp8_group: int | None = None


class RMSNormImpl(Protocol):
    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | Fp8Activation:
        """Zero-centred RMSNorm over the last dim (with ``fp8_group``: as an Fp8Activation)."""

    def forward_add(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor | Fp8Activation, torch.Tensor]:
        """``r = x + residual`` (in the activation dtype), returns ``(norm(r), r)``."""


class NormBuilder(OpBuilder[NormSpec]):
    op = "norm"
    fp8_output: ClassVar[bool] = False  # a builder serving ``fp8_group`` says so

    def contract_refusals(self, spec: NormSpec) -> list[str]:
        if spec.fp8_group is not None and not self.fp8_output:
            return [f"norm with a block-FP8 output copy (groups of {spec.fp8_group}): no kernel in "
                    f"{backend_of(type(self))} yet"]
        return []
