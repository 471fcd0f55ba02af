from __future__ import annotations

import torch

from bi_core.backends.reference.dtypes import check_dtype
from bi_core.backends.reference.linear import linear, silu_and_mul
from bi_core.backends.reference.lora import ReferenceLoraImpl
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
                w2_scale=None, x_fp8=None, lora=None) -> torch.Tensor:
        if lora is not None:
            return with_lora(x, topk_weights, topk_ids, w13, w2, shared_logits, lora)
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


def with_lora(x, topk_weights, topk_ids, w13, w2, shared_logits, lora) -> torch.Tensor:
    """Dense experts with adapter deltas (``ops/moe.py``): every (token, slot) pair's gate|up output,
    its delta (the reference lora op), SiLU-and-mul, the down output and its delta, then the
    combine of ``ReferenceMoEImpl``."""
    num_tokens, top_k = topk_ids.shape
    ids = topk_ids if shared_logits is None else torch.cat(
        [topk_ids, torch.full((num_tokens, 1), w13.shape[0] - 1, dtype=topk_ids.dtype, device=x.device)], 1)
    slots = ids.shape[1]
    flat, xp = ids.reshape(-1), x.repeat_interleave(slots, dim=0)
    g = torch.empty(flat.shape[0], w13.shape[1], dtype=x.dtype, device=x.device)
    for e in torch.unique(flat).tolist():
        g[flat == e] = linear(xp[flat == e], w13[e], None, None)
    add = ReferenceLoraImpl().forward
    add(g, xp, lora.a13, lora.b13, lora.pairs)
    gv = g.view(num_tokens, slots, -1)
    if lora.shared is not None:
        gv[:, top_k] = add(gv[:, top_k].clone(), x, lora.shared[0], lora.shared[1], lora.slots)
    h = silu_and_mul(g)
    y = torch.empty(flat.shape[0], w2.shape[1], dtype=x.dtype, device=x.device)
    for e in torch.unique(flat).tolist():
        y[flat == e] = linear(h[flat == e], w2[e], None, None)
    add(y, h, lora.a2, lora.b2, lora.pairs)
    yv, hv = y.view(num_tokens, slots, -1), h.view(num_tokens, slots, -1)
    if lora.shared is not None:
        yv[:, top_k] = add(yv[:, top_k].clone(), hv[:, top_k], lora.shared[2], lora.shared[3], lora.slots)
    weights = topk_weights.to(x.dtype)
    out = (yv[:, 0] * weights[:, 0, None]).float()
    for j in range(1, top_k):  # slot order in fp32, as ReferenceMoEImpl
        out = out + (yv[:, j] * weights[:, j, None]).float()
    out = out.to(x.dtype)
    if shared_logits is not None:
        out = out + torch.sigmoid(shared_logits[:, None]) * yv[:, top_k]
    return out


class ReferenceMoEBuilder(MoEBuilder):
    weight_formats = ("dense", "fp8_block")
    serves_lora = True

    def check(self, spec: MoESpec, policy) -> list[str]:
        return check_dtype(spec)

    def build(self, spec: MoESpec) -> ReferenceMoEImpl:
        return ReferenceMoEImpl(spec.block_size)
