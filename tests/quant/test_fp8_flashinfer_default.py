"""The default backend's block-FP8 linear: FlashInfer's SM90 GEMM from FI_FP8_MIN_ROWS rows, given
our quantized rows and their scales in the layout it reads ([K/128, M rounded up to 4], M
contiguous: it checks only their dtype, so another layout gives wrong numbers silently); the
Triton GEMM below that, for outputs that are columns of a wider buffer, and wherever FlashInfer's
kernel cannot serve the spec (named reasons). On the CPU FlashInfer's kernel is replaced by a
float32 stand-in that reads the scales in that layout; tests/gpu/test_fp8_flashinfer.py runs the
real one."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from bi_core.backends.cuda_common import kernel_calls
from bi_core.backends.cuda_default.builders import DefaultLinearBuilder, flashinfer_fp8_reasons
from bi_core.ops import LinearSpec
from bi_core.quant.fp8_numerics import dequantize_blocks, quantize_activations, quantize_blocks

CUDA = torch.device("cuda")


def test_activation_scales_in_flashinfers_layout():
    xs = torch.rand(5, 3)
    got = kernel_calls.fi_act_scales(xs)
    assert got.shape == (3, 8) and got.is_contiguous()
    assert torch.equal(got[:, :5], xs.t()) and not got[:, 5:].any()
    assert kernel_calls.fi_act_scales(torch.rand(4, 2)).shape == (2, 4)


def spec(**kw) -> LinearSpec:
    base = dict(device=CUDA, dtype=torch.bfloat16, in_features=256, out_features=384, weight_format="fp8_block",
                block_size=(128, 128))
    return LinearSpec(**{**base, **kw})


def test_the_builder_names_why_flashinfer_cannot_serve_a_spec(monkeypatch):
    monkeypatch.setattr("bi_core.backends.cuda_default.builders.require_hopper", lambda s: [])
    monkeypatch.setattr("bi_core.backends.cuda_default.builders.require_module", lambda m: [])
    assert flashinfer_fp8_reasons(spec()) == []
    assert flashinfer_fp8_reasons(spec(dtype=torch.float32)) == [
        "it writes bf16 (or fp16), the model runs torch.float32"]
    assert flashinfer_fp8_reasons(spec(out_features=320, in_features=200)) == [
        "it needs out_features % 64 == 0 and in_features % 128 == 0, not 320 x 200"]
    assert type(DefaultLinearBuilder().build(spec())) is kernel_calls.FlashInferFp8LinearImpl
    monkeypatch.setattr("bi_core.backends.cuda_default.builders.require_module",
                        lambda m: [f"package '{m}' is not installed"])
    assert flashinfer_fp8_reasons(spec()) == ["package 'flashinfer' is not installed"]
    assert type(DefaultLinearBuilder().build(spec())) is kernel_calls.Fp8LinearImpl  # the Triton GEMM


@pytest.fixture
def stand_in(monkeypatch):
    """flashinfer.gemm.fp8_blockscale_gemm_sm90, in float32, reading the scales as the real one
    does; records its calls."""
    calls = []

    def gemm(xq, w, xs, ws, out=None, out_dtype=None):
        m, k = xq.shape
        assert xs.shape == (k // 128, -(-m // 4) * 4) and xs.is_contiguous()
        rows = xq.float() * xs[:, :m].t().repeat_interleave(128, dim=1)
        y = (rows @ dequantize_blocks(w, ws, (128, 128)).t()).to(out_dtype)
        calls.append(m)
        if out is None:
            return y
        out.copy_(y)
        return out

    mod = types.ModuleType("flashinfer.gemm")
    mod.fp8_blockscale_gemm_sm90 = gemm
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setitem(sys.modules, "flashinfer.gemm", mod)
    triton_rows = []  # the rows the Triton GEMM got (it answers zeros here)

    def triton(self, x, weight, weight_scale, x_fp8, out):
        triton_rows.append(x.shape[0])
        return torch.zeros(x.shape[0], weight.shape[0], dtype=x.dtype) if out is None else out.zero_()

    monkeypatch.setattr(kernel_calls.Fp8LinearImpl, "_gemm", triton)
    return calls, triton_rows


@pytest.mark.parametrize("silu_mul", [False, True])
def test_flashinfer_gets_our_rows_and_scales_from_min_rows_on(stand_in, silu_mul):
    calls, triton_rows = stand_in
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 384, generator=g) * 0.05
    wq, ws = quantize_blocks(w, (128, 128))
    impl = kernel_calls.FlashInferFp8LinearImpl(silu_mul)
    m = kernel_calls.FI_FP8_MIN_ROWS + 3
    x = torch.randn(m, 384, generator=g).to(torch.bfloat16)
    xq, xs = quantize_activations(x.float(), 128)
    want = ((xq.float() * xs.repeat_interleave(128, dim=1)) @ dequantize_blocks(wq, ws, (128, 128)).t()).to(x.dtype)
    if silu_mul:
        gate, up = want.chunk(2, dim=-1)
        want = torch.nn.functional.silu(gate) * up
    assert torch.equal(impl.forward(x, wq, ws, x_fp8=(xq, xs)), want) and calls == [m]
    if not silu_mul:
        out = torch.empty(m, 256, dtype=x.dtype)
        assert impl.forward(x, wq, ws, x_fp8=(xq, xs), out=out) is out and torch.equal(out, want)
        wide = torch.empty(m, 512, dtype=x.dtype)  # columns of a wider buffer: the Triton GEMM writes them
        impl.forward(x, wq, ws, x_fp8=(xq, xs), out=wide[:, :256])
        assert triton_rows == [m] and calls == [m, m]
    impl.forward(x[:kernel_calls.FI_FP8_MIN_ROWS - 1], wq, ws)
    assert triton_rows[-1] == kernel_calls.FI_FP8_MIN_ROWS - 1 and calls[-1] == m
