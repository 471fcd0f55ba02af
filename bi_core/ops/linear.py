"""Dense linear layer ``y = x @ W.T`` (every projection, lm_head, router, MTP fc), optionally
with SwiGLU's SiLU-and-mul applied to a fused ``[gate; up]`` weight."""

from __future__ import annotations

from typing import Protocol

import attrs
import torch

from bi_core.ops.base import OpBuilder, OpSpec


@attrs.frozen(kw_only=True)
class LinearSpec(OpSpec):
    in_features: int
    out_features: int  # with silu_mul: the weight's rows (2N), the output has N
    silu_mul: bool = False


class LinearImpl(Protocol):
    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x [T, in] @ weight[out, in].T -> [T, out]``; with ``silu_mul``, weight is ``[gate; up]``
        and the result ``silu(x @ gate.T) * (x @ up.T)`` ``[T, out/2]``, each GEMM output rounded to
        the activation dtype, then silu, then the product (transformers' order)."""


class LinearBuilder(OpBuilder[LinearSpec]):
    op = "linear"
