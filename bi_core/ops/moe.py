"""Routed MoE experts: SwiGLU experts with fused ``gate_up [E, 2I, H]`` and ``down [E, H, I]``."""

from __future__ import annotations

from typing import Protocol

import attrs
import torch

from bi_core.ops.base import OpBuilder, OpSpec


@attrs.frozen(kw_only=True)
class MoESpec(OpSpec):
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int


class MoEImpl(Protocol):
    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        topk_weights: torch.Tensor,  # [T, k] float32
        topk_ids: torch.Tensor,  # [T, k] int64
        w13: torch.Tensor,  # [E, 2I, H]: rows [0, I) gate, [I, 2I) up
        w2: torch.Tensor,  # [E, H, I]
    ) -> torch.Tensor:  # [T, H], sum over slots of weight * expert(x)
        """The routed part of the MoE block (the shared expert is plain linears)."""


class MoEBuilder(OpBuilder[MoESpec]):
    op = "moe"
