"""Vision-op impls of the CUDA backends: the Triton kernels of ``kernels/vision.py`` (the
invariant backend's), and torch's LayerNorm and scaled-dot-product attention image by image
(the default backend's)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bi_core.ops.vision import LayerNormSpec, VisionAttentionSpec


class TritonLayerNormImpl:
    def __init__(self, spec: LayerNormSpec) -> None:
        self.eps = spec.eps

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        from bi_core.kernels.vision import layer_norm

        return layer_norm(x, weight, bias, self.eps)


class TritonVisionAttentionImpl:
    def __init__(self, spec: VisionAttentionSpec) -> None:
        self.scale = spec.scale

    def forward(self, q, k, v, cu_seqlens, cu_seqlens_host: list[int]) -> torch.Tensor:
        from bi_core.kernels.vision import vision_attention

        return vision_attention(q, k, v, cu_seqlens_host, self.scale)


class TorchLayerNormImpl:
    def __init__(self, spec: LayerNormSpec) -> None:
        self.eps = spec.eps

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), weight, bias, self.eps)


class SdpaVisionAttentionImpl:
    """torch's fused attention, one call per image (its kernel choice follows the image's shape)."""

    def __init__(self, spec: VisionAttentionSpec) -> None:
        self.scale = spec.scale

    def forward(self, q, k, v, cu_seqlens, cu_seqlens_host: list[int]) -> torch.Tensor:
        out = torch.empty_like(q)
        for a, b in zip(cu_seqlens_host[:-1], cu_seqlens_host[1:]):
            qi, ki, vi = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            out[a:b] = F.scaled_dot_product_attention(qi, ki, vi, scale=self.scale)[0].transpose(0, 1)
        return out
