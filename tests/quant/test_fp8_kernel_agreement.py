"""The reference backend's FP8 numerics against the Triton block-FP8 kernels (bi_core/kernels/fp8.py,
fp8_moe.py; the interpreter on a CPU): the same activation quantization bit for bit, the same GEMM
and MoE up to summation order. The reference is the kernels' yardstick, so they must agree."""

from __future__ import annotations

import pytest
import torch

from bi_core.backends.reference.moe import ReferenceMoEImpl
from bi_core.quant.fp8_numerics import FP8, quantize_activations, quantize_blocks, w8a8_linear

pytest.importorskip("triton")
BLOCK = (128, 128)


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


def test_activation_quantization_is_the_kernels_bit_for_bit():
    from bi_core.kernels.fp8 import quantize_act

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 320, generator=gen) * torch.exp2(torch.randint(-12, 8, (9, 1), generator=gen).float())
    x[3] = 0.0  # an all-zero row: the kernels' eps scale
    x = x.to(device())
    q, s = quantize_act(x)
    rq, rs = quantize_activations(x, 128)
    assert torch.equal(bits(q), bits(rq)) and torch.equal(s, rs)


@pytest.mark.parametrize("shape", [(5, 256, 384), (3, 200, 130)], ids=lambda s: "x".join(map(str, s)))
def test_gemm_agrees_up_to_summation_order(shape):
    from bi_core.kernels.fp8 import fp8_linear

    m, n, k = shape
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) / k**0.5
    wq, ws = quantize_blocks(w, BLOCK)
    ours = w8a8_linear(x, wq, ws, BLOCK)
    theirs = fp8_linear(x.to(device()), wq.to(device()), ws.to(device())).cpu()
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5 * float(ours.abs().max()))
    wrong = fp8_linear(x.to(device()), wq.to(device()), ws.flip(0).contiguous().to(device())).cpu()
    assert not torch.allclose(wrong, ours, rtol=1e-2, atol=1e-2 * float(ours.abs().max()))  # negative control


def test_moe_agrees_up_to_summation_order():
    from bi_core.kernels.fp8_moe import fp8_fused_moe

    gen = torch.Generator().manual_seed(2)
    e, h, i, t, k = 4, 128, 128, 6, 2
    w13, s13 = quantize_blocks(torch.randn(e + 1, 2 * i, h, generator=gen) / h**0.5, BLOCK)
    w2, s2 = quantize_blocks(torch.randn(e + 1, h, i, generator=gen) / i**0.5, BLOCK)
    x = torch.randn(t, h, generator=gen)
    weights = torch.softmax(torch.randn(t, k, generator=gen), -1)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    shared = torch.randn(t, generator=gen)
    ours = ReferenceMoEImpl(BLOCK).forward(x, weights, ids, w13, w2, shared, w13_scale=s13, w2_scale=s2)
    d = device()
    theirs = fp8_fused_moe(x.to(d), weights.to(d), ids.to(d), w13.to(d), s13.to(d), w2.to(d), s2.to(d),
                           shared.to(d)).cpu()
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4 * float(ours.abs().max()))
