from __future__ import annotations

import torch

from bi_core.backends.reference.dtypes import check_dtype
from bi_core.ops.topk import TopKBuilder, TopKSpec


class ReferenceTopKImpl:
    def __init__(self, top_k: int) -> None:
        self.top_k = top_k

    def forward(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(router_logits.float(), dim=-1)
        # A stable descending sort keeps the lower expert id first among equal probabilities.
        values, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
        values, ids = values[:, : self.top_k], ids[:, : self.top_k]
        return values / values.sum(dim=-1, keepdim=True), ids


class ReferenceTopKBuilder(TopKBuilder):
    def check(self, spec: TopKSpec, policy) -> list[str]:
        return check_dtype(spec)

    def build(self, spec: TopKSpec) -> ReferenceTopKImpl:
        return ReferenceTopKImpl(spec.top_k)
