"""Gated DeltaNet, the mixer core between in_proj and out_proj: causal depthwise conv1d with
state, the gates, the gated delta rule (chunked or recurrent form) with a float32 recurrent
state per sequence slot, and the gated RMSNorm of its output."""

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
    norm_eps: float = 1e-6

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


@attrs.frozen
class GdnWeights:
    """One GDN layer's own weights (the projections are linears around the op)."""

    conv1d: torch.Tensor  # [conv_dim, Kc]
    A_log: torch.Tensor  # [Hv] float32
    dt_bias: torch.Tensor  # [Hv] float32
    norm: torch.Tensor  # [Dv] gated RMSNorm weight (plain, not zero-centred)


class GdnImpl(Protocol):
    def forward(
        self,
        proj: torch.Tensor,  # [T, conv_dim + value_dim + 2*Hv]: in_proj output, qkv | z | b | a
        weights: GdnWeights,
        conv_state: torch.Tensor,  # [num_slots, conv_dim, Kc - 1], the last Kc-1 pre-conv rows
        state: torch.Tensor,  # [num_slots, Hv, Dv, Dk] float32 (or bfloat16): S transposed, in place
        ctx: ForwardContext,
    ) -> torch.Tensor:  # [T, value_dim], the gated-normed output (out_proj's input)
        """silu(conv(qkv)) -> q, k, v; beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias);
        q, k L2-normalised, q scaled by Dk^-0.5, value head h reads key head h // (Hv/Hk); then
        ``w * rmsnorm(o) * silu(z)`` per value head. Sequences with ``ctx.is_recurrent_host[i]``
        use the per-token recurrent form, others the chunked form; a new sequence (past length
        0) starts from zero states."""


class GdnBuilder(OpBuilder[GdnSpec]):
    op = "gdn"
