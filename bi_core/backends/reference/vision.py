"""Reference vision ops: torch's LayerNorm, and eager attention image by image (transformers'
eager order: scores in the model dtype, softmax in float32, cast, times v)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bi_core.backends.reference.dtypes import check_dtype
from bi_core.ops.vision import LayerNormBuilder, LayerNormSpec, VisionAttentionBuilder, VisionAttentionSpec


class ReferenceLayerNormImpl:
    def __init__(self, spec: LayerNormSpec) -> None:
        self.spec = spec

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), weight, bias, self.spec.eps)


class ReferenceLayerNormBuilder(LayerNormBuilder):
    def check(self, spec: LayerNormSpec, policy) -> list[str]:
        return check_dtype(spec)

    def build(self, spec: LayerNormSpec) -> ReferenceLayerNormImpl:
        return ReferenceLayerNormImpl(spec)


def eager_image_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One image's bidirectional attention, ``[n, H, D]`` each."""
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("hqk,khd->qhd", probs, v)


class ReferenceVisionAttentionImpl:
    def __init__(self, spec: VisionAttentionSpec) -> None:
        self.spec = spec

    def forward(self, q, k, v, cu_seqlens, cu_seqlens_host: list[int]) -> torch.Tensor:
        out = torch.empty_like(q)
        for a, b in zip(cu_seqlens_host[:-1], cu_seqlens_host[1:]):
            out[a:b] = eager_image_attention(q[a:b], k[a:b], v[a:b], self.spec.scale)
        return out


class ReferenceVisionAttentionBuilder(VisionAttentionBuilder):
    def check(self, spec: VisionAttentionSpec, policy) -> list[str]:
        return check_dtype(spec)

    def build(self, spec: VisionAttentionSpec) -> ReferenceVisionAttentionImpl:
        return ReferenceVisionAttentionImpl(spec)
