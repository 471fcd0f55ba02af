from __future__ import annotations

import torch
import torch.nn.functional as F

from bi_core.backends.reference.common import check_dtype
from bi_core.ops.moe import MoEBuilder, MoESpec


class ReferenceMoEImpl:
    """Loops over the experts hit; each (token, slot) output is kept, then summed in slot order in
    fp32, so the combine does not depend on expert order. Weights are applied in the model dtype
    like transformers does."""

    def forward(self, x, topk_weights, topk_ids, w13, w2) -> torch.Tensor:
        num_tokens, top_k = topk_ids.shape
        per_slot = torch.zeros(num_tokens, top_k, x.shape[1], dtype=torch.float32, device=x.device)
        weights = topk_weights.to(x.dtype)
        for e in torch.unique(topk_ids).tolist():
            rows, slots = torch.nonzero(topk_ids == e, as_tuple=True)
            gate, up = F.linear(x[rows], w13[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, w2[e])
            per_slot[rows, slots] = (y * weights[rows, slots, None]).float()
        out = per_slot[:, 0]
        for j in range(1, top_k):
            out = out + per_slot[:, j]
        return out.to(x.dtype)


class ReferenceMoEBuilder(MoEBuilder):
    def check(self, spec: MoESpec, policy) -> list[str]:
        return check_dtype(spec)

    def build(self, spec: MoESpec) -> ReferenceMoEImpl:
        return ReferenceMoEImpl()
