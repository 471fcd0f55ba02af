"""Routed MoE experts and the shared expert: SwiGLU experts with fused ``gate_up [E', 2I, H]``
and ``down [E', H, I]``, where E' = E + 1 when the shared expert is stored as the last expert;
dense or block-wise FP8 weights (``WeightedSpec``); with ``lora``, per-(token, slot) LoRA deltas
inside the experts (``ExpertLora``, ``bi_core/lora/experts.py``)."""

from __future__ import annotations

from typing import ClassVar, Protocol

import attrs
import torch

from bi_core.ops.base import OpBuilder
from bi_core.ops.linear import FormatGuard, WeightedSpec


@attrs.frozen(kw_only=True)
class MoESpec(WeightedSpec):
    num_experts: int  # routed experts
    top_k: int
    hidden_size: int
    intermediate_size: int
    shared_expert: bool = False  # w13/w2 carry one more expert, gated by sigmoid(shared logit)
    lora: bool = False  # forward gets ``lora`` (ExpertLora): adapter deltas per (token, slot)


@attrs.frozen
class ExpertLora:
    """One step's expert adapters: stacks in the ``lora`` op's layout (``ops/lora.py``). Routed
    experts: row ``slot * E + expert`` of ``a13 [S*E, R, H]``, ``b13 [S*E, 2I, R]``, ``a2 [S*E, R,
    I]``, ``b2 [S*E, H, R]``, picked by ``pairs`` (one per (token, slot) in that order, the shared
    expert's slot included; -1: none, always at the shared slot). The shared expert: row ``slot``
    of its own stacks (``shared``, None without one; gate and up own separate rank columns),
    picked by ``slots [T]``."""

    a13: torch.Tensor
    b13: torch.Tensor
    a2: torch.Tensor
    b2: torch.Tensor
    pairs: torch.Tensor
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None
    slots: torch.Tensor


class MoEImpl(Protocol):
    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        topk_weights: torch.Tensor,  # [T, k] float32
        topk_ids: torch.Tensor,  # [T, k] int64
        w13: torch.Tensor,  # [E', 2I, H]: rows [0, I) gate, [I, 2I) up
        w2: torch.Tensor,  # [E', H, I]
        shared_logits: torch.Tensor | None = None,  # [T] (shared_expert): the shared expert's gate logit
        *,
        w13_scale: torch.Tensor | None = None,  # fp8_block: float32 [E', 2I/bn, ceil(H/bk)]
        w2_scale: torch.Tensor | None = None,  # fp8_block: float32 [E', ceil(H/bn), I/bk]
        x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,  # fp8_block: x quantized (a norm's copy)
        lora: ExpertLora | None = None,  # spec.lora: the step's expert adapters
    ) -> torch.Tensor:  # [T, H]
        """``Σ_j w_j · expert_{id_j}(x)`` in fp32 in slot order (weights in the model dtype), then
        ``+ sigmoid(shared_logit) · expert_E(x)``, each term rounded like transformers. ``fp8_block``:
        w13/w2 float8_e4m3fn with their block scales, each expert GEMM W8A8 like the linear op (its
        input rows quantized per token in groups of ``bk``); dense impls get no scale arguments.
        ``lora``: each pair's gate|up GEMM output rounded, its delta added (the ``lora`` op's
        arithmetic), SiLU-and-mul, the down GEMM output rounded, its delta added, then the same
        combine: a pair's bits depend on its token, expert and adapter only (PEFT's semantics:
        the delta of the fused gate_up parameter before the SiLU, of down_proj after it)."""


class MoEBuilder(FormatGuard, OpBuilder[MoESpec]):
    op = "moe"
    serves_lora: ClassVar[bool] = False  # a builder declares that its impl takes ``lora``

    def contract_refusals(self, spec) -> list[str]:
        out = super().contract_refusals(spec)
        if spec.lora and not self.serves_lora:
            out.append("MoE experts with LoRA adapters (lora.experts): this builder's impl does not apply them")
        if spec.lora and spec.weight_format != "dense":
            out.append("MoE experts with LoRA adapters (lora.experts) on FP8 experts: not supported yet")
        return out
