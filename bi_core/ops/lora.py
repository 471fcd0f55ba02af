"""Per-row LoRA delta ``y[t] += (x[t] @ A[s].T) @ B[s].T`` with ``s = slots[t]`` (``-1``: no
adapter, the row is left as it is), over adapters stacked in fixed slots: ``A [slots, R, K]``,
``B [slots, N, R]`` (ranks zero-padded to ``R``, each slot's scale folded into its ``B``). Every
row's delta is computed alone in a fixed arithmetic (``h = round(x @ A.T)`` in float32, then
``round(h @ B.T)`` in float32, then added to ``y`` in the activation dtype), so a row's bits depend
on its input and its own adapter only, not on which adapters or how many rows share the batch."""

from __future__ import annotations

from typing import Protocol

import attrs
import torch

from bi_core.ops.base import OpBuilder, OpSpec


@attrs.frozen(kw_only=True)
class LoraSpec(OpSpec):
    """One projection's adapter stack: ``in_features`` K, ``out_features`` N (the base GEMM's
    output columns, before any SiLU-and-mul), ``rank`` R (the padded rank of a slot), ``max_loras``
    slots; ``silu_mul``: the op also applies SwiGLU's ``silu(gate) * up`` after the delta (the
    base GEMM of a fused ``[gate; up]`` projection then runs without it)."""

    in_features: int
    out_features: int
    rank: int
    max_loras: int
    part_rank: int = 0  # R is parts of this width (one per fused part); 0: one part of R
    silu_mul: bool = False


class LoraImpl(Protocol):
    def forward(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                slots: torch.Tensor, ranks: torch.Tensor | None = None) -> torch.Tensor:
        """``y [T, N]`` (the base output, written in place), ``x [T, K]`` (the dense input),
        ``a [S, R, K]``, ``b [S, N, R]``, ``slots [T]`` int64 -> ``y`` with each row's delta added,
        then (``silu_mul``) ``silu(y[:, :N/2]) * y[:, N/2:]`` as a new tensor. ``ranks [S]``
        int32 (optional): slot s uses only the first ``ranks[s]`` columns of each ``part_rank``-wide
        part of R (the others are zero): an impl may skip them, which changes no bit (the products
        it skips are zeros)."""


class LoraBuilder(OpBuilder[LoraSpec]):
    op = "lora"
