"""Reference linear: ``F.linear`` on dense weights; on block-FP8 weights the W8A8 emulation in
float32 (``bi_core.quant.fp8_numerics.w8a8_linear``: activations quantized per token in groups of 128 and
dequantized, weights dequantized, one float32 GEMM), rounded to the activation dtype. That is the
yardstick for FP8 kernels: what they compute up to the summation order. (``weight_only_linear``
is the other product there, a dequantized model with unquantized activations; tests use it.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bi_core.backends.reference.dtypes import check_dtype
from bi_core.ops.linear import LinearBuilder, LinearSpec
from bi_core.quant.fp8_numerics import w8a8_linear


def silu_and_mul(y: torch.Tensor) -> torch.Tensor:
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int] | None,
           x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``x @ weight.T`` in the activation dtype: dense, or W8A8 in float32 with ``scale``'s blocks
    (``x_fp8``: x's quantization, when a norm made it)."""
    if block is None:
        return F.linear(x, weight)
    if scale is None:
        raise ValueError("a block-FP8 weight needs its block scales")
    return w8a8_linear(x, weight, scale, block, x_fp8).to(x.dtype)


class ReferenceLinearImpl:
    def __init__(self, silu_mul: bool = False, block: tuple[int, int] | None = None) -> None:
        self.silu_mul, self.block = silu_mul, block

    def forward(self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None,
                x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        y = linear(x, weight, weight_scale, self.block, x_fp8)
        return silu_and_mul(y) if self.silu_mul else y


class ReferenceLinearBuilder(LinearBuilder):
    weight_formats = ("dense", "fp8_block")

    def check(self, spec: LinearSpec, policy) -> list[str]:
        return check_dtype(spec)

    def build(self, spec: LinearSpec) -> ReferenceLinearImpl:
        return ReferenceLinearImpl(spec.silu_mul, spec.block_size)
