"""Small impls that are one call into a Triton kernel or a torch op."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class CublasLinearImpl:
    """cuBLAS through torch: fastest, but its kernel choice depends on M (not batch-invariant)."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)


class TritonLinearImpl:
    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        from bi_core.kernels.gemm import linear

        return linear(x, weight)


class TritonRMSNormImpl:
    def __init__(self, eps: float) -> None:
        self.eps = eps

    def forward(self, x, weight):
        from bi_core.kernels.norm import rms_norm

        return rms_norm(x, weight, self.eps)

    def forward_add(self, x, residual, weight):
        from bi_core.kernels.norm import rms_norm

        return rms_norm(x, weight, self.eps, residual=residual)


class TritonGatedRMSNormImpl:
    def __init__(self, eps: float) -> None:
        self.eps = eps

    def forward(self, x, gate, weight):
        from bi_core.kernels.norm import gated_rms_norm

        return gated_rms_norm(x, gate, weight, self.eps)


class TritonTopKImpl:
    def __init__(self, top_k: int) -> None:
        self.top_k = top_k

    def forward(self, router_logits):
        from bi_core.kernels.topk import softmax_topk

        return softmax_topk(router_logits, self.top_k)


class TritonMoEImpl:
    def forward(self, x, topk_weights, topk_ids, w13, w2):
        from bi_core.kernels.moe import fused_moe

        return fused_moe(x, topk_weights, topk_ids, w13, w2)
