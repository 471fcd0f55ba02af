"""Builders of the cuda_default backend: what each op needs, and which impl serves it."""

from __future__ import annotations

import torch

from bi_core.backends.cuda_common import kernel_calls
from bi_core.backends.cuda_common.reasons import cuda_reasons
from bi_core.backends.reference.collective import ReferenceAllGatherBuilder, ReferenceAllReduceBuilder
from bi_core.ops import (
    AttentionBuilder,
    GdnBuilder,
    LinearBuilder,
    LoraBuilder,
    MoEBuilder,
    NormBuilder,
    SamplingBuilder,
    TopKBuilder,
)
from bi_core.ops.base import require_hopper, require_module
from bi_core.ops.vision import LayerNormBuilder, VisionAttentionBuilder

BF16_FP32 = (torch.bfloat16, torch.float32)


def rope_reasons(spec) -> list[str]:
    """What the fused q/k-norm + RoPE kernel needs."""
    if spec.rotary_dim % 2 or not 0 < spec.rotary_dim <= spec.head_dim:
        return [f"rotary_dim must be even and in (0, head_dim], not {spec.rotary_dim}"]
    return []


class DefaultAttentionBuilder(AttentionBuilder):
    def check(self, spec, policy):
        reasons = cuda_reasons(spec, modules=("flashinfer",))
        if spec.head_dim not in (64, 128, 256):
            reasons.append(f"FlashInfer supports head_dim 64/128/256, not {spec.head_dim}")
        if spec.kv_cache_dtype != "auto":
            reasons.append(f"KV cache {spec.kv_cache_dtype}: FlashInfer's FP8 KV path is not wired here yet "
                           "(policy.ops: {attention: cuda_hopper_invariant} serves it in default mode)")
        return reasons + rope_reasons(spec)

    def build(self, spec):
        from bi_core.backends.cuda_common.attention import FlashInferAttentionImpl

        return FlashInferAttentionImpl(spec)


class DefaultLinearBuilder(LinearBuilder):
    # block-FP8: FlashInfer's SM90 GEMM where it serves the spec (flashinfer_fp8_reasons), from
    # kernel_calls.FI_FP8_MIN_ROWS rows; the Triton kernel of kernels/fp8.py below that and elsewhere
    weight_formats = ("dense", "fp8_block")

    def check(self, spec, policy):
        return cuda_reasons(spec, dtypes=BF16_FP32, modules=()) + fp8_reasons(spec)

    def build(self, spec):
        if spec.weight_format == "fp8_block":
            if not flashinfer_fp8_reasons(spec):
                return kernel_calls.FlashInferFp8LinearImpl(spec.silu_mul)
            return kernel_calls.Fp8LinearImpl(spec.silu_mul)
        return kernel_calls.CublasLinearImpl(spec.silu_mul)


def flashinfer_fp8_reasons(spec) -> list[str]:
    """Why FlashInfer's block-FP8 GEMM (``fp8_blockscale_gemm_sm90``) cannot serve a linear spec."""
    reasons = require_hopper(spec) + require_module("flashinfer")
    if spec.dtype != torch.bfloat16:
        reasons.append(f"it writes bf16 (or fp16), the model runs {spec.dtype}")
    if spec.out_features % 64 or spec.in_features % 128:
        reasons.append(f"it needs out_features % 64 == 0 and in_features % 128 == 0, not "
                       f"{spec.out_features} x {spec.in_features}")
    return reasons


def fp8_reasons(spec) -> list[str]:
    """The block-FP8 Triton kernels take 128 x 128 weight blocks only."""
    if getattr(spec, "weight_format", "dense") == "fp8_block" and tuple(spec.block_size or ()) != (128, 128):
        return [f"block-FP8 kernels take 128 x 128 weight blocks, not {spec.block_size}"]
    return []


class DefaultNormBuilder(NormBuilder):
    fp8_output = True

    def check(self, spec, policy):
        reasons = cuda_reasons(spec, dtypes=BF16_FP32)
        if spec.fp8_group not in (None, 128):
            reasons.append(f"the norm's FP8 copy is written in groups of 128 columns, not {spec.fp8_group}")
        return reasons

    def build(self, spec):
        return kernel_calls.TritonRMSNormImpl(spec.eps, spec.fp8_group)


class DefaultTopKBuilder(TopKBuilder):
    def check(self, spec, policy):
        return cuda_reasons(spec, dtypes=BF16_FP32)

    def build(self, spec):
        return kernel_calls.TritonTopKImpl(spec.top_k)


class DefaultMoEBuilder(MoEBuilder):
    weight_formats = ("dense", "fp8_block")  # block-FP8 experts: the Triton kernels of kernels/fp8_moe.py
    serves_lora = True  # expert adapters: kernels/moe_lora.py

    def check(self, spec, policy):
        return cuda_reasons(spec, dtypes=BF16_FP32) + fp8_reasons(spec)

    def build(self, spec):
        return kernel_calls.TritonMoEImpl()


class DefaultGdnBuilder(GdnBuilder):
    pin_autotune = False

    def check(self, spec, policy):
        reasons = cuda_reasons(spec, modules=("triton", "fla"), hopper=self.is_batch_invariant)
        if spec.conv_kernel != 4:
            reasons.append(f"the conv kernel is written for width 4, not {spec.conv_kernel}")
        if spec.num_v_heads % spec.num_k_heads:
            reasons.append("num_v_heads must be a multiple of num_k_heads")
        for name in ("head_k_dim", "head_v_dim"):
            dim = getattr(spec, name)
            if dim & (dim - 1) or dim > 256:
                reasons.append(f"{name} must be a power of two <= 256, not {dim}")
        return reasons

    def build(self, spec):
        from bi_core.backends.cuda_common.gdn import CudaGdnImpl

        return CudaGdnImpl(spec, pin_autotune=self.pin_autotune)


class DefaultSamplingBuilder(SamplingBuilder):
    def check(self, spec, policy):
        return cuda_reasons(spec, dtypes=BF16_FP32)

    def build(self, spec):
        from bi_core.backends.cuda_common.sampling import CudaSamplerImpl

        return CudaSamplerImpl()


class DefaultAllReduceBuilder(ReferenceAllReduceBuilder):
    """NCCL's all-reduce (its algorithm follows the message size: not batch-invariant)."""

    def check(self, spec, policy):
        return cuda_reasons(spec, dtypes=BF16_FP32, modules=()) + super().check(spec, policy)


class DefaultAllGatherBuilder(ReferenceAllGatherBuilder):
    def check(self, spec, policy):
        return cuda_reasons(spec, dtypes=BF16_FP32, modules=()) + super().check(spec, policy)


class DefaultLoraBuilder(LoraBuilder):
    """Per-row LoRA through the gather mat-vec kernel (its fastest path here as well)."""

    def check(self, spec, policy):
        return cuda_reasons(spec, dtypes=BF16_FP32)

    def build(self, spec):
        return kernel_calls.TritonLoraImpl(spec.silu_mul, spec.part_rank)


class DefaultLayerNormBuilder(LayerNormBuilder):
    def check(self, spec, policy):
        return cuda_reasons(spec, dtypes=BF16_FP32, modules=())

    def build(self, spec):
        from bi_core.backends.cuda_common.vision import TorchLayerNormImpl

        return TorchLayerNormImpl(spec)


class DefaultVisionAttentionBuilder(VisionAttentionBuilder):
    def check(self, spec, policy):
        return cuda_reasons(spec, dtypes=BF16_FP32, modules=())

    def build(self, spec):
        from bi_core.backends.cuda_common.vision import SdpaVisionAttentionImpl

        return SdpaVisionAttentionImpl(spec)
