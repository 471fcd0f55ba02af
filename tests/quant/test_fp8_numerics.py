"""Block-wise FP8 numerics (bi_core/quant/fp8_numerics.py): weight blocks and activation groups scaled by
amax / 448, rows independent of each other, and the W8A8 product the reference backend runs."""

from __future__ import annotations

import torch

from bi_core.quant import fp8_numerics
from bi_core.quant.fp8_numerics import (
    FP8,
    dequantize_blocks,
    quantize_activations,
    quantize_blocks,
    w8a8_linear,
    weight_only_linear,
)

BLOCK = (128, 128)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


def test_weight_blocks_match_a_loop_over_blocks():
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(0))  # partial blocks on both dims
    q, s = quantize_blocks(w, BLOCK)
    assert q.dtype == FP8 and s.dtype == torch.float32 and s.shape == (3, 2)
    for i in range(3):
        for j in range(2):
            block = w[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]
            scale = block.abs().max() / 448
            assert s[i, j] == scale
            expected = (block / scale).clamp(-448, 448).to(FP8)
            assert torch.equal(_bits(q[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]), _bits(expected))
    back = dequantize_blocks(q, s, BLOCK)
    assert float((back - w).norm() / w.norm()) < 0.04
    assert torch.equal(back.abs().amax(), w.abs().amax())  # a block's amax is exact (448 * scale)


def test_expert_stacks_are_quantized_matrix_by_matrix(monkeypatch):
    w = torch.randn(5, 256, 130, generator=torch.Generator().manual_seed(1))
    q, s = quantize_blocks(w, BLOCK)
    monkeypatch.setattr(fp8_numerics, "CHUNK", 256 * 130 * 2)  # the chunked path: two experts at a time
    qc, sc = quantize_blocks(w, BLOCK)
    assert torch.equal(_bits(q), _bits(qc)) and torch.equal(s, sc)
    for e in range(5):
        qe, se = quantize_blocks(w[e], BLOCK)
        assert torch.equal(_bits(q[e]), _bits(qe)) and torch.equal(s[e], se)


def test_zero_blocks_and_groups_stay_zero():
    w = torch.zeros(128, 256)
    w[:, 128:] = torch.randn(128, 128)
    q, s = quantize_blocks(w, BLOCK)
    assert s[0, 0] == 0 and s[0, 1] > 0 and not q.float().isnan().any()
    assert torch.equal(dequantize_blocks(q, s, BLOCK)[:, :128], torch.zeros(128, 128))
    qx, sx = quantize_activations(w[:2], 128)  # a padding row of a batch: zeros, the kernels' eps scale
    assert torch.equal(sx[:, 0], torch.full((2,), 1e-10) / 448) and torch.equal(qx.float()[:, :128], torch.zeros(2, 128))


def test_activation_rows_do_not_depend_on_other_rows():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(16, 300, generator=gen)
    q, s = quantize_activations(x, 128)
    assert s.shape == (16, 3)
    for r in range(16):  # a row alone, the rows permuted, another row changed: the same bits
        qr, sr = quantize_activations(x[r:r + 1], 128)
        assert torch.equal(_bits(q[r:r + 1]), _bits(qr)) and torch.equal(s[r:r + 1], sr)
    perm = torch.randperm(16, generator=gen)
    qp, sp = quantize_activations(x[perm], 128)
    assert torch.equal(_bits(qp), _bits(q[perm])) and torch.equal(sp, s[perm])
    y = x.clone()
    y[5] *= 1000
    qy, sy = quantize_activations(y, 128)
    assert torch.equal(_bits(qy[:5]), _bits(q[:5])) and not torch.equal(sy[5], s[5])
    # negative control: one scale for the whole batch would tie the rows together
    whole = x.abs().amax() / 448
    assert not torch.equal(s[0], whole.expand(3))


def test_w8a8_is_the_blockwise_kernel_product():
    """What a block-FP8 kernel accumulates (per K block: fp8 dot products times both scales) equals
    the reference's float32 emulation up to summation order; activation quantization is applied
    (the weight-only product differs)."""
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(7, 384, generator=gen), torch.randn(256, 384, generator=gen) / 20
    qw, sw = quantize_blocks(w, BLOCK)
    qx, sx = quantize_activations(x, 128)
    kernel = torch.zeros(7, 256, dtype=torch.float64)
    for kb in range(3):
        cols = slice(128 * kb, 128 * (kb + 1))
        dots = qx[:, cols].double() @ qw[:, cols].double().T
        kernel += dots * sx[:, kb:kb + 1].double() * sw[:, kb].repeat_interleave(128).double()
    ours = w8a8_linear(x, qw, sw, BLOCK)
    assert float((ours.double() - kernel).abs().max() / kernel.abs().max()) < 1e-6
    weight_only = weight_only_linear(x, qw, sw, BLOCK)
    assert float((weight_only.double() - kernel).abs().max() / kernel.abs().max()) > 1e-3
