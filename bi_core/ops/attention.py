"""Attention over a paged KV cache: causal, GQA, prefill (ragged queries) and decode rows mixed."""

from __future__ import annotations

from typing import Protocol

import attrs
import torch

from bi_core.ops.base import OpBuilder, OpSpec
from bi_core.ops.context import ForwardContext


@attrs.frozen(kw_only=True)
class AttentionSpec(OpSpec):
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float


class AttentionImpl(Protocol):
    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:  # [T, Hq, D]
        """Write k/v into the cache at ``ctx.slot_mapping``, then attend causally over each sequence."""


class AttentionBuilder(OpBuilder[AttentionSpec]):
    op = "attention"
