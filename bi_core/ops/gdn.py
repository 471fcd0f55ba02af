"""Gated DeltaNet: causal depthwise conv1d with state, and the gated delta rule (chunked or
recurrent form) with a float32 recurrent state per sequence slot."""

from __future__ import annotations

from typing import Protocol

import attrs
import torch

from bi_core.ops.base import OpBuilder, OpSpec
from bi_core.ops.context import ForwardContext


@attrs.frozen(kw_only=True)
class GdnSpec(OpSpec):
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim


class GdnImpl(Protocol):
    def conv(
        self,
        x: torch.Tensor,  # [T, conv_dim], pre-conv projections
        weight: torch.Tensor,  # [conv_dim, Kc]
        conv_state: torch.Tensor,  # [num_slots, conv_dim, Kc - 1], the last Kc-1 pre-conv rows
        ctx: ForwardContext,
    ) -> torch.Tensor:  # [T, conv_dim], silu(conv(x)); conv_state updated in place
        """Causal depthwise conv + SiLU; rows before a sequence's first token come from its state
        (zeros for a new sequence)."""

    def delta_rule(
        self,
        q: torch.Tensor,  # [T, Hk, Dk]
        k: torch.Tensor,  # [T, Hk, Dk]
        v: torch.Tensor,  # [T, Hv, Dv]
        g: torch.Tensor,  # [T, Hv] float32, log decay
        beta: torch.Tensor,  # [T, Hv]
        state: torch.Tensor,  # [num_slots, Hv, Dk, Dv] float32, updated in place
        ctx: ForwardContext,
    ) -> torch.Tensor:  # [T, Hv, Dv] in v's dtype
        """L2-normalises q and k, scales q by Dk^-0.5, value head h reads key head h // (Hv/Hk).
        Sequences with ``ctx.is_recurrent_host[i]`` use the per-token recurrent form, others the
        chunked form; a new sequence (past length 0) starts from a zero state."""


class GdnBuilder(OpBuilder[GdnSpec]):
    op = "gdn"
