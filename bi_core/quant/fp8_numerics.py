"""Block-wise FP8 numerics, as the official Qwen3.5-*-FP8 checkpoints and W8A8 "dynamic" kernels use
them (DeepSeek-V3 style; vLLM ``per_token_group_quant_fp8`` / ``w8a8_block_fp8_matmul``):

* weights ``[..., N, K]``: float8_e4m3fn values and one float32 scale per ``bn x bk`` block
  (``weight_scale_inv [..., ceil(N/bn), ceil(K/bk)]``, partial blocks at the ends), scale =
  amax(block) / 448, value = round_to_e4m3(w / scale); ``w ~= value * scale`` (an all-zero
  block: scale 0, values 0);
* activations ``[T, K]``: per row and ``bk``-column group, scale = max(amax, 1e-10) / 448 (a
  row's numbers never depend on another row), the same rounding (correctly rounded division, ties
  to even: the arithmetic of ``bi_core/kernels/fp8.py``'s ``quantize_act``).

Two float32 products are defined here: ``w8a8_linear`` (activations quantized and dequantized,
weights dequantized, one float32 GEMM: what a W8A8 kernel computes, up to its summation order;
the reference backend runs this one) and ``weight_only_linear`` (activations as they are, weights
dequantized: a dequantized bf16/fp32 model).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
ACT_EPS = 1e-10  # floor of an activation group's amax (vLLM's and bi_core/kernels/fp8.py's): zeros get a finite scale
CHUNK = 1 << 26  # elements quantized at once (bounds the float32 temporaries of a large expert stack)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def over_fp8_max(amax: torch.Tensor) -> torch.Tensor:
    """``amax / 448``, correctly rounded on every device (the kernels' ``div_rn``). torch on CUDA
    divides by a Python number as a multiplication by its rounded reciprocal, one ulp off for some
    inputs (``div_true_kernel_cuda``'s CPU-scalar branch: on a GPU, scales one ulp below the
    kernels'); a 0-d tensor on the same device takes the true division."""
    return amax / torch.full((), FP8_MAX, dtype=amax.dtype, device=amax.device)


def _divisor(scale: torch.Tensor) -> torch.Tensor:
    """An all-zero weight block has scale 0 and values 0 (divided by 1, not 0)."""
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The block-scale shape of a weight of ``shape`` ``[..., N, K]``."""
    *lead, n, k = shape
    return (*lead, _cdiv(n, block[0]), _cdiv(k, block[1]))


def _quantize_2d_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    *lead, n, k = w.shape
    bn, bk = block
    nb, kb = _cdiv(n, bn), _cdiv(k, bk)
    padded = F.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n))  # zeros change no amax
    blocks = padded.reshape(*lead, nb, bn, kb, bk)
    scale = over_fp8_max(blocks.abs().amax(dim=(-3, -1)))
    q = (blocks / _divisor(scale)[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(*lead, nb * bn, kb * bk)[..., :n, :k].contiguous(), scale


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., N, K]`` (any float dtype) -> (float8_e4m3fn ``[..., N, K]``, float32 scales
    ``[..., ceil(N/bn), ceil(K/bk)]``); a stack of matrices (experts) is quantized matrix by matrix."""
    if w.dim() < 2:
        raise ValueError(f"a block-quantized weight has at least 2 dims, got shape {tuple(w.shape)}")
    if w.dim() == 2 or w.numel() <= CHUNK:
        return _quantize_2d_blocks(w, block)
    flat = w.reshape(-1, *w.shape[-2:])
    step = max(1, CHUNK // (w.shape[-2] * w.shape[-1]))
    parts = [_quantize_2d_blocks(flat[i:i + step], block) for i in range(0, flat.shape[0], step)]
    q, s = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    return q.reshape(w.shape), s.reshape(scale_shape(tuple(w.shape), block))


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` per block, in float32, then cast to ``dtype``."""
    n, k = q.shape[-2:]
    expected = scale_shape(tuple(q.shape), block)
    if tuple(scale.shape) != expected:
        raise ValueError(f"block scales of shape {tuple(scale.shape)} for a weight of shape {tuple(q.shape)} and "
                         f"block {list(block)}; expected {expected}")
    s = scale.float().repeat_interleave(block[0], dim=-2)[..., :n, :].repeat_interleave(block[1], dim=-1)[..., :k]
    return (q.float() * s).to(dtype)


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., K]`` -> (float8_e4m3fn ``[..., K]``, float32 scales ``[..., ceil(K/group)]``): one
    scale per row and ``group`` consecutive columns (the last group may be partial)."""
    *lead, k = x.shape
    kb = _cdiv(k, group)
    groups = F.pad(x.float(), (0, kb * group - k)).reshape(*lead, kb, group)
    scale = over_fp8_max(groups.abs().amax(dim=-1).clamp(min=ACT_EPS))
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(*lead, kb * group)[..., :k], scale


def dequantize_activations(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    k = q.shape[-1]
    return q.float() * scale.repeat_interleave(group, dim=-1)[..., :k]


def w8a8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """W8A8 emulation in float32: ``dequant(quant(x)) @ dequant(q, scale).T``; activations in groups
    of ``block[1]`` (the weight's K block), or ``x_fp8``, their quantization already made (a norm's
    copy, ``ops/activation.py``). ``x [T, K]`` -> ``[T, N]`` float32."""
    xq, xs = quantize_activations(x, block[1]) if x_fp8 is None else x_fp8
    return F.linear(dequantize_activations(xq, xs, block[1]), dequantize_blocks(q, scale, block))


def weight_only_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``x @ dequant(q, scale).T`` in float32, activations unquantized (a dequantized model)."""
    return F.linear(x.float(), dequantize_blocks(q, scale, block))
