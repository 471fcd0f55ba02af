"""The vision tower's own ops (Qwen3.5's ViT; the text ops do not fit): LayerNorm with a bias
(``layer_norm``: every vision block's two norms and the patch merger's), and bidirectional
attention within each image or video over ``cu_seqlens`` (``vision_attention``: no cache, no
mask but the image boundaries). Projections go through the ``linear`` op, the rotary positions
and activations are element-wise (each row's values depend on that row alone)."""

from __future__ import annotations

from typing import Protocol

import attrs
import torch

from bi_core.ops.base import OpBuilder, OpSpec


@attrs.frozen(kw_only=True)
class LayerNormSpec(OpSpec):
    hidden_size: int
    eps: float


class LayerNormImpl(Protocol):
    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """``(x - mean) * rsqrt(var + eps) * weight + bias`` over the last dim, float32 inside,
        cast back to ``x``'s dtype (torch's LayerNorm); a row's result depends on that row alone."""


class LayerNormBuilder(OpBuilder[LayerNormSpec]):
    op = "layer_norm"


@attrs.frozen(kw_only=True)
class VisionAttentionSpec(OpSpec):
    num_heads: int
    head_dim: int
    scale: float


class VisionAttentionImpl(Protocol):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                cu_seqlens_host: list[int]) -> torch.Tensor:
        """``q, k, v [T, H, D]`` (rotated already) of several images laid end to end, image i's rows
        ``cu_seqlens[i]:cu_seqlens[i+1]``; returns ``[T, H, D]``: softmax(q k^T * scale) v within
        each image, never across (the image's rows alone decide its result)."""


class VisionAttentionBuilder(OpBuilder[VisionAttentionSpec]):
    op = "vision_attention"
