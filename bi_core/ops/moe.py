"""Routed MoE experts and the shared expert: SwiGLU experts with fused ``gate_up [E', 2I, H]``
and ``down [E', H, I]``, where E' = E + 1 when the shared expert is stored as the last expert;
dense or block-wise FP8 weights (``WeightedSpec``)."""

from __future__ import annotations

from typing import Protocol

import attrs
import torch

from bi_core.ops.base import OpBuilder
from bi_core.ops.linear import FormatGuard, WeightedSpec


@attrs.frozen(kw_only=True)
class MoESpec(WeightedSpec):
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
        *,
        w13_scale: torch.Tensor | None = None,  # fp8_block: float32 [E', 2I/bn, ceil(H/bk)]
        w2_scale: torch.Tensor | None = None,  # fp8_block: float32 [E', ceil(H/bn), I/bk]
        x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,  # fp8_block: x quantized (a norm's copy)
    ) -> torch.Tensor:  # [T, H]
        """``Σ_j w_j · expert_{id_j}(x)`` in fp32 in slot order (weights in the model dtype), then
        ``+ sigmoid(shared_logit) · expert_E(x)``, each term rounded like transformers. ``fp8_block``:
        w13/w2 float8_e4m3fn with their block scales, each expert GEMM W8A8 like the linear op (its
        input rows quantized per token in groups of ``bk``); dense impls get no scale arguments."""


class MoEBuilder(FormatGuard, OpBuilder[MoESpec]):
    op = "moe"
