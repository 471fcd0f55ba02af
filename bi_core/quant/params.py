"""How a model holds FP8 weights: a float8_e4m3fn parameter and its float32 block scales (a
parameter named like it plus ``_scale_inv``), split over tensor-parallel ranks block by block.

The weight parameter carries ``fp8`` (its :class:`Fp8Weights`), ``scale_inv`` (the scale
parameter) and ``dense_dtype`` (the model dtype: FP8 values are quantized from weights rounded to
it, whatever the path: load, random init, update); the scale parameter carries ``block_scale``.
"""

from __future__ import annotations

import attrs
import torch
from torch import nn

from bi_core.errors import ConfigError
from bi_core.parallel.shard import Shard, TPInfo
from bi_core.quant.fp8_numerics import FP8, quantize_blocks, scale_shape
from bi_core.quant.scheme import Fp8Weights

SCALE_SUFFIX = "_scale_inv"  # "x.weight" -> "x.weight_scale_inv" (the checkpoints' name), "x.w13" -> "x.w13_scale_inv"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@attrs.frozen
class BlockShard:
    """A weight's :class:`Shard` at block granularity: the part of its scales a rank holds."""

    weight: Shard
    block: int

    @property
    def dim(self) -> int:
        return self.weight.dim

    def ranges(self, rank: int, world: int) -> list[tuple[int, int]]:
        return [(lo // self.block, _cdiv(hi, self.block)) for lo, hi in self.weight.ranges(rank, world)]

    def local_size(self, world: int) -> int:
        return sum(hi - lo for lo, hi in self.ranges(0, world))

    def take(self, full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        pieces = [full.narrow(self.dim, lo, hi - lo) for lo, hi in self.ranges(rank, world)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, self.dim)


def _block_along(shape: tuple[int, ...], dim: int, fp8: Fp8Weights) -> int:
    return fp8.block[0] if dim == len(shape) - 2 else fp8.block[1]


def check_layout(shape: tuple[int, ...], fp8: Fp8Weights, tp: TPInfo, shard: Shard | None) -> None:
    """Raise unless every fused part (but the last) is whole blocks and no rank's share cuts a block."""
    if shard is None:
        return
    b, size = _block_along(shape, shard.dim, fp8), shape[shard.dim]
    sizes = [s for s, _ in shard.parts]
    if any(s % b for s in sizes[:-1]):
        raise ConfigError("model.quantization", f"FP8 {fp8.label}: the engine fuses parts of {sizes} rows into one "
                          f"weight, and each part but the last must be whole {b}-row blocks (a checkpoint's scales "
                          "are per part); this model's shapes cannot be held in block FP8")
    for rank in range(tp.world):
        for lo, hi in shard.ranges(rank, tp.world):
            if lo % b or (hi % b and hi != size):
                what = "rows" if shard.dim == len(shape) - 2 else "columns"
                raise ConfigError("parallel.tensor_parallel_size", f"{tp.world} ranks would cut a {b}-wide FP8 block "
                                  f"of {fp8.label}: rank {rank} would hold {what} [{lo}, {hi}) of {size}; use a size "
                                  f"that splits it on {b}-{what[:-1]} boundaries")


def block_shard(shape: tuple[int, ...], fp8: Fp8Weights, shard: Shard | None) -> BlockShard | None:
    return None if shard is None else BlockShard(shard, _block_along(shape, shard.dim, fp8))


def attach(weight: nn.Parameter, scale: nn.Parameter, fp8: Fp8Weights, dense_dtype: torch.dtype) -> None:
    """Mark ``weight`` as FP8 with its ``scale`` parameter."""
    weight.fp8, weight.scale_inv, weight.dense_dtype = fp8, scale, dense_dtype
    scale.block_scale = True


def is_fp8(p: torch.Tensor) -> bool:
    return getattr(p, "scale_inv", None) is not None


def is_block_scale(p: torch.Tensor) -> bool:
    return getattr(p, "block_scale", False)


@torch.no_grad()
def store(weight: nn.Parameter, values: torch.Tensor) -> None:
    """Quantize ``values`` (this rank's part of the weight, full precision) block-wise into
    ``weight`` and its scales, from the values rounded to the model dtype; narrower experts'
    padding (``zero_pad``) is zeroed first, as a checkpoint of the unquantized model holds it."""
    values = values.to(weight.device, weight.dense_dtype)
    zero_pad = getattr(weight, "zero_pad", None)
    if zero_pad is not None:
        zero_pad(values)
    q, s = quantize_blocks(values, weight.fp8.block)
    weight.copy_(q)
    weight.scale_inv.copy_(s)


# ---------------------------------------------------------------------------------- random init


def draw_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The full shape the unquantized model draws for ``p`` (an FP8 GDN in_proj draws its bf16 tail's
    rows with it, so both models get the same numbers)."""
    return tuple(getattr(p, "draw_shape", None) or getattr(p, "full_shape", p.shape))


def drawn_elsewhere(p: torch.Tensor) -> bool:
    """Block scales (written with their weight) and rows drawn with another parameter."""
    return is_block_scale(p) or getattr(p, "drawn_with_head", False)


@torch.no_grad()
def write_drawn(p: nn.Parameter, values: torch.Tensor) -> None:
    """Write randomly drawn full ``values`` (shape ``draw_shape(p)``): this rank's part, the rows of
    a parameter drawn with it, FP8 weights quantized with their scales."""
    shard = getattr(p, "draw_shard", None) or getattr(p, "shard", None)
    tp = getattr(p, "tp", None)
    if shard is not None and tp is not None:
        values = shard.take(values, tp.rank, tp.world)
    tail = getattr(p, "drawn_tail", None)
    if tail is not None:
        tail.copy_(values[p.shape[0]:].to(tail.dtype))
        values = values[: p.shape[0]]
    if is_fp8(p):
        store(p, values.to(p.dense_dtype, copy=True))  # a copy in the model dtype (store rounds to it anyway)
    else:
        p.copy_(values.to(p.dtype))


def scale_param(shape: tuple[int, ...], fp8: Fp8Weights, device, tp: TPInfo, shard: Shard | None) -> nn.Parameter:
    """Zeroed float32 block scales for a weight of full ``shape``: this rank's blocks."""
    check_layout(shape, fp8, tp, shard)
    full = scale_shape(shape, fp8.block)
    bshard = block_shard(shape, fp8, shard)
    p = nn.Parameter(torch.zeros(tp.local_shape(full, bshard), dtype=torch.float32, device=device),
                     requires_grad=False)
    if bshard is not None and tp.world > 1:
        p.shard, p.full_shape, p.tp = bshard, full, tp
    return p


def fp8_dtype(fp8: Fp8Weights | None, dtype: torch.dtype) -> torch.dtype:
    return dtype if fp8 is None else FP8
