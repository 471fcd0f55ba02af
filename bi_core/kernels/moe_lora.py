"""MoE experts with LoRA adapters (``ops/moe.py`` ``ExpertLora``): the grouped GEMMs of
``kernels/moe.py`` without the fused SiLU epilogue, each pair's deltas added between them by the
per-row LoRA kernel (``kernels/lora.py``), then the same slot-order combine. Every step is per row
in a fixed arithmetic (a grouped-GEMM row's K order is fixed by (N, K); a LoRA row is one
program), so a pair's bits depend on its token, its expert and its adapter only."""

from __future__ import annotations

import torch

from bi_core.kernels.elementwise import silu_mul
from bi_core.kernels.lora import lora_apply
from bi_core.kernels.moe import align, grouped_gemm, moe_combine


def moe_lora(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
             w2: torch.Tensor, shared_logits: torch.Tensor | None, lora) -> torch.Tensor:
    """``fused_moe`` with each pair's adapter deltas (``lora``: an ExpertLora)."""
    num_tokens, top_k = topk_ids.shape
    routing = align(topk_ids, w13.shape[0], shared=shared_logits is not None)
    slots = routing.slots
    g = grouped_gemm(x, w13, routing, a_row_div=slots)  # [T*slots, 2I], pairs in (token, slot) order
    lora_apply(g, x.repeat_interleave(slots, dim=0), lora.a13, lora.b13, lora.pairs)  # routed pairs
    if lora.shared is not None:  # the shared expert's rows (each token's last slot), strided in place
        lora_apply(g.view(num_tokens, slots, -1)[:, top_k], x, lora.shared[0], lora.shared[1], lora.slots)
    h = silu_mul(g)
    y = grouped_gemm(h, w2, routing, a_row_div=1)  # [T*slots, H]
    lora_apply(y, h, lora.a2, lora.b2, lora.pairs)
    if lora.shared is not None:
        lora_apply(y.view(num_tokens, slots, -1)[:, top_k], h.view(num_tokens, slots, -1)[:, top_k],
                   lora.shared[2], lora.shared[3], lora.slots)
    return moe_combine(y, topk_weights, shared_logits)
