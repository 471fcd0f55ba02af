"""Dense linear layer ``y = x @ W.T`` (every projection, lm_head, router, MTP fc), optionally
with SwiGLU's SiLU-and-mul applied to a fused ``[gate; up]`` weight; the weight in the activation
dtype (``dense``) or in block-wise FP8 (``fp8_block``, W8A8: ``bi_core/quant/fp8_numerics.py``)."""

from __future__ import annotations

from typing import ClassVar, Protocol

import attrs
import torch

from bi_core.ops.base import OpBuilder, OpSpec, backend_of

WEIGHT_FORMATS = {"dense": "dense", "fp8_block": "block-FP8"}  # spec value -> how messages name it


@attrs.frozen(kw_only=True)
class WeightedSpec(OpSpec):
    """An op spec with weights, stored: ``dense`` (the activation dtype) or ``fp8_block``
    (float8_e4m3fn, one float32 scale per ``block_size`` (N, K) block, activations quantized per
    token in groups of ``block_size[1]`` at run time)."""

    weight_format: str = "dense"
    block_size: tuple[int, int] | None = None

    def __attrs_post_init__(self) -> None:
        if self.weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"weight_format must be one of {', '.join(WEIGHT_FORMATS)}, not {self.weight_format!r}")
        if (self.block_size is None) != (self.weight_format == "dense"):
            raise ValueError(f"weight_format {self.weight_format} {'needs' if self.block_size is None else 'takes no'} "
                             "block_size")


@attrs.frozen(kw_only=True)
class LinearSpec(WeightedSpec):
    in_features: int
    out_features: int  # with silu_mul: the weight's rows (2N), the output has N
    silu_mul: bool = False


class LinearImpl(Protocol):
    def forward(self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None,
                x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``x [T, in] @ weight[out, in].T -> [T, out]`` in the activation dtype; with ``silu_mul``,
        weight is ``[gate; up]`` and the result ``silu(x @ gate.T) * (x @ up.T)`` ``[T, out/2]``,
        each GEMM output rounded to the activation dtype, then silu, then the product
        (transformers' order). ``fp8_block``: ``weight`` float8_e4m3fn ``[out, in]``, ``weight_scale``
        float32 ``[ceil(out/bn), ceil(in/bk)]`` (``w = weight * scale`` per block); ``x`` quantized
        per row in groups of ``bk`` columns (scale = amax / 448), so a row's result depends on that
        row alone; ``x_fp8`` (when the norm before wrote it, ``ops/activation.py``) is that
        quantization, bitwise, to be used in its place. Dense impls are called with two arguments.

        An impl that sets ``writes_into = True`` also takes ``out=``, a ``[T, out]`` tensor of unit
        column stride and any row stride (columns of a wider buffer: projections whose outputs
        sit side by side), and writes the result there with the same bits; the model copies the
        result of any other impl."""


class FormatGuard:
    """Base of the linear and MoE builders: a builder serves the weight formats it lists in
    ``weight_formats`` (dense only unless it says more); a spec of another format is refused before
    the builder's own check runs (``OpBuilder.contract_refusals``), so a builder written before FP8
    existed never receives FP8 weights it would misread."""

    weight_formats: ClassVar[tuple[str, ...]] = ("dense",)

    def contract_refusals(self, spec) -> list[str]:
        if spec.weight_format not in self.weight_formats:
            return [f"{WEIGHT_FORMATS[spec.weight_format]} {self.op}: no kernel in {backend_of(type(self))} yet"]
        return []


class LinearBuilder(FormatGuard, OpBuilder[LinearSpec]):
    op = "linear"
