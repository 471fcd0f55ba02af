"""Dense linear layer ``y = x @ W.T`` (every projection, lm_head, router, MTP fc)."""

from __future__ import annotations

from typing import Protocol

import attrs
import torch

from bi_core.ops.base import OpBuilder, OpSpec


@attrs.frozen(kw_only=True)
class LinearSpec(OpSpec):
    in_features: int
    out_features: int


class LinearImpl(Protocol):
    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x [T, in] @ weight[out, in].T -> [T, out]``."""


class LinearBuilder(OpBuilder[LinearSpec]):
    op = "linear"
