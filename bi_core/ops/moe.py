"""Routed MoE experts and the shared expert: SwiGLU experts with fused ``gate_up [E', 2I, H]``
and ``down [E', H, I]``, where E' = E + 1 when the shared expert is stored as the last expert."""

from __future__ import annotations

from typing import Protocol

import attrs
import torch

from bi_core.ops.base import OpBuilder, OpSpec


@attrs.frozen(kw_only=True)
class MoESpec(OpSpec):
    num_experts: int  # routed experts
    top_k: int
    hidden_size: int
    intermediate_size: int
    shared_expert: bool = False  # w13/w2 carry one more expert, gated by sigmoid(shared logit)


class MoEImpl(Protocol):
    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        topk_weights: torch.Tensor,  # [T, k] float32
        topk_ids: torch.Tensor,  # [T, k] int64
        w13: torch.Tensor,  # [E', 2I, H]: rows [0, I) gate, [I, 2I) up
        w2: torch.Tensor,  # [E', H, I]
        shared_logits: torch.Tensor | None = None,  # [T] (shared_expert): the shared expert's gate logit
    ) -> torch.Tensor:  # [T, H]
        """``Σ_j w_j · expert_{id_j}(x)`` in fp32 in slot order (weights in the model dtype), then
        ``+ sigmoid(shared_logit) · expert_E(x)``, each term rounded like transformers."""


class MoEBuilder(OpBuilder[MoESpec]):
    op = "moe"
