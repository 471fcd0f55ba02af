"""MoE router: softmax over expert logits, top-k, renormalise (ties go to the lower expert id)."""

from __future__ import annotations

from typing import Protocol

import attrs
import torch

from bi_core.ops.base import OpBuilder, OpSpec


@attrs.frozen(kw_only=True)
class TopKSpec(OpSpec):
    num_experts: int
    top_k: int


class TopKImpl(Protocol):
    def forward(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, E]`` logits -> (weights ``[T, k]`` float32 summing to 1, expert ids ``[T, k]`` int64)."""


class TopKBuilder(OpBuilder[TopKSpec]):
    op = "topk"
