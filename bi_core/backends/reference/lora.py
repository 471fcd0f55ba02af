"""Reference LoRA: a plain PyTorch loop over the rows, each row's two products of one fixed
shape (``[1, K] @ [K, R]``, ``[1, R] @ [R, N]``) in float32, so a row's delta never depends on the
other rows; the arithmetic the Triton kernels follow (``bi_core/kernels/lora.py``)."""

from __future__ import annotations

import torch

from bi_core.backends.reference.dtypes import check_dtype
from bi_core.backends.reference.linear import silu_and_mul
from bi_core.ops.lora import LoraBuilder, LoraSpec


def row_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One row's delta ``[1, N]`` in ``x``'s dtype: ``round(round(x @ a.T) @ b.T)``, float32 sums."""
    h = (x.float() @ a.float().T).to(x.dtype)
    return (h.float() @ b.float().T).to(x.dtype)


class ReferenceLoraImpl:
    def __init__(self, silu_mul: bool = False) -> None:
        self.silu_mul = silu_mul

    def forward(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                slots: torch.Tensor, ranks: torch.Tensor | None = None) -> torch.Tensor:
        for t, s in enumerate(slots.tolist()):
            if s >= 0:
                y[t:t + 1] += row_delta(x[t:t + 1], a[s], b[s])
        return silu_and_mul(y) if self.silu_mul else y


class ReferenceLoraBuilder(LoraBuilder):
    def check(self, spec: LoraSpec, policy) -> list[str]:
        return check_dtype(spec)

    def build(self, spec: LoraSpec) -> ReferenceLoraImpl:
        return ReferenceLoraImpl(spec.silu_mul)
