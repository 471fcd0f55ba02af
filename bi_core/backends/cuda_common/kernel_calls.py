"""Small impls that are one call into a Triton kernel or a torch op."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bi_core.ops.activation import Fp8Activation


class CublasLinearImpl:
    """cuBLAS through torch: fastest, but its kernel choice depends on M (not batch-invariant)."""

    def __init__(self, silu_mul: bool = False) -> None:
        self.silu_mul = silu_mul

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, weight)
        if not self.silu_mul:
            return y
        from bi_core.kernels.elementwise import silu_mul

        return silu_mul(y)


class TritonLinearImpl:
    """The fixed-K-order split-K GEMM (``kernels/gemm.py``), SiLU-and-mul in its epilogue."""

    writes_into = True  # out= (LinearImpl)

    def __init__(self, device: torch.device, silu_mul: bool = False) -> None:
        from bi_core.kernels.gemm import tile_locks

        self.silu_mul = silu_mul
        tile_locks(device)  # allocated now, never inside a CUDA-graph capture

    def forward(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        from bi_core.kernels.gemm import linear

        if out is not None:  # (checked here: kernels/gemm.py's text keys its compile manifests' entries)
            n = weight.shape[0] // (2 if self.silu_mul else 1)
            assert out.shape == (*x.shape[:-1], n) and out.stride(1) == 1 and out.dtype == x.dtype, \
                "out: [M, N], unit column stride"
        return linear(x, weight, out=out, silu_mul=self.silu_mul)


class Fp8LinearImpl:
    """Block-FP8 W8A8 (``kernels/fp8.py``): activations quantized per token and 128-column group
    (or given quantized: ``x_fp8``, a norm's copy), K blocks summed in a fixed order
    (batch-invariant). With ``silu_mul`` the GEMM output is rounded to the activation dtype, then
    SiLU(gate) * up, as the reference does."""

    def __init__(self, silu_mul: bool = False) -> None:
        self.silu_mul = silu_mul
        self.writes_into = not silu_mul  # out= (LinearImpl); SiLU-and-mul runs after the GEMM

    def forward(self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None,
                x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None, out: torch.Tensor | None = None
                ) -> torch.Tensor:
        assert out is None or not self.silu_mul
        y = self._gemm(x, weight, weight_scale, x_fp8, out)
        if not self.silu_mul:
            return y
        gate, up = y.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    def _gemm(self, x, weight, weight_scale, x_fp8, out) -> torch.Tensor:
        from bi_core.kernels.fp8 import fp8_gemm, fp8_linear

        if x_fp8 is None:
            return fp8_linear(x, weight, weight_scale, out=out)
        return fp8_gemm(*x_fp8, weight, weight_scale, x.dtype, out=out)


# cuda_default's block-FP8 linear runs FlashInfer's GEMM from this many rows on: it wins at prefill
# sizes; at graphed decode sizes the two are even (our Triton GEMM overlaps its predecessor under PDL,
# FlashInfer's waits and needs the scales' layout launch); below this, its GEMM plus that launch loses
# to ours on most shapes (dev/benchmarks-history.md)
FI_FP8_MIN_ROWS = 64


def fi_act_scales(xs: torch.Tensor) -> torch.Tensor:
    """Activation scales ``[M, K/128]`` (``quantize_act``'s) in the layout FlashInfer's block-FP8 GEMM
    reads them (DeepGEMM's TMA layout): ``[K/128, M rounded up to 4]``, M contiguous. Its wrapper
    checks only their dtype: scales in another layout give wrong numbers without an error."""
    return torch.nn.functional.pad(xs.t(), (0, -xs.shape[0] % 4)).contiguous()


class FlashInferFp8LinearImpl(Fp8LinearImpl):
    """The default backend's block-FP8 linear: FlashInfer's SM90 block-scale GEMM
    (``fp8_blockscale_gemm_sm90``, TensorRT-LLM's DeepGEMM-style kernels) from FI_FP8_MIN_ROWS rows,
    on the rows quantized as the Triton path quantizes them (``quantize_act``, or the norm's copy);
    fewer rows, and outputs that are columns of a wider buffer, run the Triton GEMM. Its bits
    differ from the Triton GEMM's by a rounding in a few elements, which the default mode allows."""

    def _gemm(self, x, weight, weight_scale, x_fp8, out) -> torch.Tensor:
        if x.shape[0] < FI_FP8_MIN_ROWS or (out is not None and not out.is_contiguous()):
            return super()._gemm(x, weight, weight_scale, x_fp8, out)
        from flashinfer.gemm import fp8_blockscale_gemm_sm90

        from bi_core.kernels.fp8 import quantize_act

        xq, xs = x_fp8 if x_fp8 is not None else quantize_act(x)
        return fp8_blockscale_gemm_sm90(xq, weight, fi_act_scales(xs), weight_scale, out=out, out_dtype=x.dtype)


class TritonRMSNormImpl:
    """``kernels/norm.py``; with ``fp8_group`` (128) the output comes with its FP8 copy, one launch."""

    def __init__(self, eps: float, fp8_group: int | None = None) -> None:
        self.eps, self.fp8 = eps, fp8_group is not None

    def forward(self, x, weight):
        from bi_core.kernels.norm import rms_norm, rms_norm_fp8

        if not self.fp8:
            return rms_norm(x, weight, self.eps)
        y, _, yq, ys = rms_norm_fp8(x, weight, self.eps)
        return Fp8Activation(y, yq, ys)

    def forward_add(self, x, residual, weight):
        from bi_core.kernels.norm import rms_norm, rms_norm_fp8

        if not self.fp8:
            return rms_norm(x, weight, self.eps, residual=residual)
        y, r, yq, ys = rms_norm_fp8(x, weight, self.eps, residual=residual)
        return Fp8Activation(y, yq, ys), r


class TritonTopKImpl:
    def __init__(self, top_k: int) -> None:
        self.top_k = top_k

    def forward(self, router_logits):
        from bi_core.kernels.topk import softmax_topk

        return softmax_topk(router_logits, self.top_k)


class TritonMoEImpl:
    def forward(self, x, topk_weights, topk_ids, w13, w2, shared_logits=None, *, w13_scale=None, w2_scale=None,
                x_fp8=None, lora=None):
        if lora is not None:  # expert adapters (dense experts: the builder refuses FP8 with them)
            from bi_core.kernels.moe_lora import moe_lora

            return moe_lora(x, topk_weights, topk_ids, w13, w2, shared_logits, lora)
        if w13_scale is not None:  # block-FP8 experts (kernels/fp8_moe.py)
            from bi_core.kernels.fp8_moe import fp8_fused_moe

            return fp8_fused_moe(x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale, shared_logits, x_fp8=x_fp8)
        from bi_core.kernels.moe import fused_moe

        return fused_moe(x, topk_weights, topk_ids, w13, w2, shared_logits)


class GroupedMMMoEImpl:
    """Routed experts through ``torch._grouped_mm`` (CUTLASS grouped GEMM on SM90): pairs sorted by
    expert, one grouped GEMM per projection, then the same fp32 slot-order combine. Its kernel and
    tiling follow the per-expert row counts, so it makes no invariance promise."""

    def forward(self, x, topk_weights, topk_ids, w13, w2, shared_logits=None):
        from bi_core.kernels.elementwise import silu_mul
        from bi_core.kernels.moe import moe_combine

        num_tokens, top_k = topk_ids.shape
        if shared_logits is not None:  # the shared expert is the last expert, one more slot per token
            shared = torch.full((num_tokens, 1), w13.shape[0] - 1, dtype=topk_ids.dtype, device=x.device)
            topk_ids = torch.cat([topk_ids, shared], dim=1)
        slots = topk_ids.shape[1]
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(w13.shape[0], dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        offs = torch.cumsum(counts, 0).to(torch.int32)
        h = torch._grouped_mm(x[order // slots], w13.transpose(1, 2), offs=offs)
        y_sorted = torch._grouped_mm(silu_mul(h), w2.transpose(1, 2), offs=offs)
        y = torch.empty_like(y_sorted)
        y[order] = y_sorted
        return moe_combine(y, topk_weights, shared_logits)


class TritonLoraImpl:
    """Per-row LoRA through the gather mat-vec kernel (``kernels/lora.py``), then SwiGLU's
    SiLU-and-mul (``kernels/elementwise.py``) for a fused ``[gate; up]`` projection."""

    def __init__(self, silu_mul: bool = False, part_rank: int = 0) -> None:
        self.silu_mul, self.part_rank = silu_mul, part_rank

    def forward(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                slots: torch.Tensor, ranks: torch.Tensor | None = None) -> torch.Tensor:
        from bi_core.kernels.lora import lora_apply

        y = lora_apply(y, x, a, b, slots, ranks, self.part_rank)
        if not self.silu_mul:
            return y
        from bi_core.kernels.elementwise import silu_mul

        return silu_mul(y)
