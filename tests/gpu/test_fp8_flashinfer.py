"""FlashInfer's block-FP8 GEMM for Hopper (``fp8_blockscale_gemm_sm90``) as the default backend's
FP8 linear from kernel_calls.FI_FP8_MIN_ROWS rows: its numbers against the Triton GEMM's on the same
quantized rows, its rows' bits at M = 1..1024 and under a permutation (the record for a later use
in the invariant backend; the negative control, a GEMM whose split count follows M, must fail the
same check), and a default-mode FP8 engine with graphs that runs it."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config

from bi_core import EngineConfig, SamplingParams, build_engine
from bi_core.backends.cuda_common import kernel_calls

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                       reason="FlashInfer's block-FP8 GEMM: SM90 only"),
]
fi = pytest.importorskip("flashinfer.gemm")

SHAPES = [(2048, 2048), (4096, 2048), (2048, 512), (12352, 2048)]  # the 35B-A3B's dense (N, K)


def weights(n, k):
    from bi_core.quant.fp8_numerics import quantize_blocks

    g = torch.Generator(device="cuda").manual_seed(n + k)
    return quantize_blocks(torch.randn(n, k, device="cuda", generator=g) * 0.02, (128, 128))


def fi_gemm(xq, xs, wq, ws):
    return fi.fp8_blockscale_gemm_sm90(xq, wq, kernel_calls.fi_act_scales(xs), ws, out_dtype=torch.bfloat16)


@pytest.mark.parametrize("n,k", SHAPES)
def test_flashinfer_linear_is_the_triton_linear_up_to_a_rounding(n, k):
    from bi_core.kernels.fp8 import quantize_act

    wq, ws = weights(n, k)
    for m in (kernel_calls.FI_FP8_MIN_ROWS, 64, 257, 1024):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        want = kernel_calls.Fp8LinearImpl().forward(x, wq, ws)
        got = kernel_calls.FlashInferFp8LinearImpl().forward(x, wq, ws)
        assert got.shape == want.shape and got.dtype == want.dtype
        err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
        differing = float((got != want).float().mean())
        assert err < 1e-2 and differing < 0.02, (m, err, differing)
        q = quantize_act(x)  # a norm's copy: the same rows, given
        assert torch.equal(kernel_calls.FlashInferFp8LinearImpl().forward(x, wq, ws, x_fp8=q), got)
        out = torch.empty_like(got)
        assert kernel_calls.FlashInferFp8LinearImpl().forward(x, wq, ws, out=out) is out and torch.equal(out, got)


def rows_mismatch(gemm, xq, xs, sizes):
    """The M of ``sizes`` at which ``gemm`` of the first M rows differs from those rows of the whole
    batch, and whether a permutation of the batch permutes its rows' bits."""
    full = gemm(xq, xs)
    bad = [m for m in sizes if not torch.equal(gemm(xq[:m].contiguous(), xs[:m].contiguous()), full[:m])]
    perm = torch.randperm(xq.shape[0], device="cuda")
    return bad, torch.equal(gemm(xq[perm].contiguous(), xs[perm].contiguous()), full[perm])


@pytest.mark.parametrize("n,k", SHAPES)
def test_flashinfer_gemm_rows_do_not_depend_on_the_batch(n, k):
    from bi_core.kernels.fp8 import fp8_config, fp8_gemm, quantize_act

    wq, ws = weights(n, k)
    x = torch.randn(1024, k, device="cuda") * torch.exp2(torch.randint(-4, 4, (1024, 1), device="cuda").float())
    xq, xs = quantize_act(x.to(torch.bfloat16))
    sizes = range(1, 1025) if (n, k) == (2048, 2048) else (1, 2, 3, 7, 8, 16, 31, 32, 33, 63, 64, 65, 255, 257, 1000)
    bad, permuted = rows_mismatch(lambda a, s: fi_gemm(a, s, wq, ws), xq, xs, sizes)
    assert bad == [] and permuted
    # negative control: the Triton GEMM with a split count that follows M (2 ranges up to 64 rows,
    # 1 beyond) fails the same check
    follows_m = lambda a, s: fp8_gemm(a, s, wq, ws, torch.bfloat16,
                                      config={**fp8_config(a.shape[0], n, k), "SPLIT_K": 2 if a.shape[0] <= 64 else 1})
    assert rows_mismatch(follows_m, xq, xs, (1, 8, 64))[0]


def test_default_fp8_engine_runs_flashinfer_with_graphs(monkeypatch):
    """A default-mode FP8 engine (graph buckets past FI_FP8_MIN_ROWS) calls FlashInfer's GEMM and
    decodes what the same engine does on the Triton GEMM alone, up to near-ties."""
    calls = []
    real = fi.fp8_blockscale_gemm_sm90
    monkeypatch.setattr(fi, "fp8_blockscale_gemm_sm90", lambda *a, **k: calls.append(
        (a[0].shape[0], torch.cuda.is_current_stream_capturing())) or real(*a, **k))
    cfg = EngineConfig.from_dict(tiny_config(
        model={"random": {"preset": "tiny-moe-b128", "seed": 0}, "dtype": "bfloat16", "device": "cuda",
               "max_model_len": 1024, "quantization": "fp8"},
        backend="cuda_default", policy={"batch_invariant": False}, graph={"enabled": True},
        scheduler={"max_num_seqs": 80, "max_num_batched_tokens": 2048}, cache={"num_blocks": 2048}))
    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in torch.randint(8, 120, (72,), generator=g)]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    outs = build_engine(cfg).generate(ps, params)
    assert max(m for m, _ in calls) >= kernel_calls.FI_FP8_MIN_ROWS  # prefill
    assert any(captured for _, captured in calls), "no decode graph captured FlashInfer's GEMM"
    monkeypatch.setattr(kernel_calls, "FI_FP8_MIN_ROWS", 1 << 30)  # the Triton GEMM everywhere
    triton = build_engine(cfg).generate(ps, params)
    first = [float(o.token_logprobs[0]) for o in outs]
    want = [float(o.token_logprobs[0]) for o in triton]
    assert max(abs(a - b) for a, b in zip(first, want)) < 0.05
    assert sum(o.token_ids == t.token_ids for o, t in zip(outs, triton)) >= 54
