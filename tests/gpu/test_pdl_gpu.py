"""Kernels launched with programmatic dependent launch, eager and inside a CUDA graph: each waits
for the previous grid before reading, so a dependent chain (split-K GEMM with its counters, norm,
per-pair MoE with its combine counters) gives bitwise what plain launches give, eager and replay
after replay."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_pdl_graph_chain_equals_eager():
    from bi_core.kernels import common
    from bi_core.kernels.gemm import linear
    from bi_core.kernels.moe import fused_moe
    from bi_core.kernels.norm import rms_norm
    from bi_core.kernels.topk import softmax_topk

    if not common._supported():
        pytest.skip("PDL needs SM90+ and Triton's gdc_wait")
    torch.manual_seed(0)
    h, e, inter = 2048, 64, 512
    w_in = torch.randn(4096, h, device="cuda", dtype=torch.bfloat16) / h**0.5
    w_out = torch.randn(h, 4096, device="cuda", dtype=torch.bfloat16) / 64  # split-K 8
    router = torch.randn(e + 1, h, device="cuda", dtype=torch.bfloat16) / h**0.5
    w13 = torch.randn(e + 1, 2 * inter, h, device="cuda", dtype=torch.bfloat16) / h**0.5
    w2 = torch.randn(e + 1, h, inter, device="cuda", dtype=torch.bfloat16) / inter**0.5
    norm_w = 0.1 * torch.randn(h, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4, h, device="cuda", dtype=torch.bfloat16)

    def chain():
        y = x
        for _ in range(4):  # each kernel reads what the previous one wrote
            y, res = rms_norm(linear(linear(y, w_in), w_out), norm_w, 1e-6, residual=y)
            logits = linear(y, router)
            wts, ids = softmax_topk(logits[:, :e], 8)
            y = fused_moe(y, wts, ids, w13, w2, logits[:, e]) + res
        return y

    common._pdl_supported = False  # the yardstick: plain launches, no wait compiled in
    try:
        plain = chain()
    finally:
        common._pdl_supported = True
    assert torch.equal(chain(), plain)  # eager PDL launches (compiled here, outside the capture)
    with common.early_launch(True):  # as the graph runner captures small steps: successors start early
        assert torch.equal(chain(), plain)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, plain)
