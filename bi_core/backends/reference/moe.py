from __future__ import annotations

import torch

from bi_core.backends.reference.dtypes import check_dtype
from bi_core.backends.reference.linear import linear, silu_and_mul
from bi_core.ops.moe import MoEBuilder, MoESpec


def expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, s13: torch.Tensor | None = None,
           s2: torch.Tensor | None = None, block: tuple[int, int] | None = None,
           x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    return linear(silu_and_mul(linear(x, w13, s13, block, x_fp8)), w2, s2, block)


class ReferenceMoEImpl:
    """Loops over the experts hit; each (token, slot) output is kept, then summed in slot order in
    fp32, so the combine does not depend on expert order. Weights are applied in the model dtype
    like transformers does; the shared expert's gated output is added in the model dtype. Block-FP8
    experts run each GEMM as the reference linear does (W8A8 in float32, rounded to the model dtype)."""

    def __init__(self, block: tuple[int, int] | None = None) -> None:
        self.block = block

    def forward(self, x, topk_weights, topk_ids, w13, w2, shared_logits=None, *, w13_scale=None,
                w2_scale=None, x_fp8=None) -> torch.Tensor:
        def scales(e):
            return (None, None) if self.block is None else (w13_scale[e], w2_scale[e])

        num_tokens, top_k = topk_ids.shape
        per_slot = torch.zeros(num_tokens, top_k, x.shape[1], dtype=torch.float32, device=x.device)
        weights = topk_weights.to(x.dtype)
        for e in torch.unique(topk_ids).tolist():
            rows, slots = torch.nonzero(topk_ids == e, as_tuple=True)
            y = expert(x[rows], w13[e], w2[e], *scales(e), self.block,
                       None if x_fp8 is None else (x_fp8[0][rows], x_fp8[1][rows]))
            per_slot[rows, slots] = (y * weights[rows, slots, None]).float()
        out = per_slot[:, 0]
        for j in range(1, top_k):
            out = out + per_slot[:, j]
        out = out.to(x.dtype)
        if shared_logits is not None:
            out = out + torch.sigmoid(shared_logits[:, None]) * expert(x, w13[-1], w2[-1], *scales(-1), self.block,
                                                                       x_fp8)
        return out


class ReferenceMoEBuilder(MoEBuilder):
    weight_formats = ("dense", "fp8_block")

    def check(self, spec: MoESpec, policy) -> list[str]:
        return check_dtype(spec)

    def build(self, spec: MoESpec) -> ReferenceMoEImpl:
        return ReferenceMoEImpl(spec.block_size)
