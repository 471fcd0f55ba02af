"""Each Triton kernel against the reference backend on fresh random inputs (outputs poisoned)."""

from __future__ import annotations

import pytest
import torch

from bi_core.backends.reference.attention import ReferenceAttentionImpl, write_kv
from bi_core.backends.reference.gdn import ReferenceGdnImpl
from bi_core.backends.reference.moe import ReferenceMoEImpl
from bi_core.backends.reference.norm import ReferenceGatedRMSNormImpl, ReferenceRMSNormImpl
from bi_core.backends.reference.topk import ReferenceTopKImpl
from bi_core.ops.attention import AttentionSpec
from bi_core.ops.gdn import GdnSpec
from bi_core.runtime.batch import build_context


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def ragged_ctx(query_lens, past_lens, device, block_size=16):
    blocks, nxt = [], 0
    for q, p in zip(query_lens, past_lens):
        n = -(-(q + p) // block_size)
        blocks.append(list(range(nxt, nxt + n)))
        nxt += n + 1  # leave holes so pages are not contiguous
    ids, ctx = build_context([[0] * q for q in query_lens], past_lens, blocks, list(range(len(query_lens))),
                             [q == 1 and p > 0 for q, p in zip(query_lens, past_lens)], block_size=block_size,
                             device=device)
    return ctx, nxt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(device, dtype):
    from bi_core.kernels.norm import gated_rms_norm, rms_norm

    x, r = torch.randn(7, 96, device=device, dtype=dtype), torch.randn(7, 96, device=device, dtype=dtype)
    w = 0.1 * torch.randn(96, device=device, dtype=dtype)
    ref = ReferenceRMSNormImpl(1e-6)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    assert rel(rms_norm(x, w, 1e-6), ref.forward(x, w)) < tol
    y, res = rms_norm(x, w, 1e-6, residual=r)
    y_ref, res_ref = ref.forward_add(x, r, w)
    assert rel(y, y_ref) < tol
    # Triton's interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even): exact on the GPU only.
    if device.type == "cuda" or dtype == torch.float32:
        assert torch.equal(res, res_ref)
    else:
        assert rel(res, res_ref) < 1e-2
    g = torch.randn(7, 96, device=device, dtype=dtype)
    got, want = gated_rms_norm(x, g, w + 1, 1e-6), ReferenceGatedRMSNormImpl(1e-6).forward(x, g, w + 1)
    # three bf16 roundings in a row: the interpreter truncates each (a ~1% bias); the GPU rounds
    gated_tol = 3e-2 if (dtype == torch.bfloat16 and device.type == "cpu") else tol
    assert rel(got, want) < gated_tol


def gdn_spec(device, dtype):
    return GdnSpec(dtype=dtype, device=device, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=32,
                   conv_kernel=4)


def test_conv1d_ragged_with_state(device):
    from bi_core.kernels.conv1d import causal_conv1d

    spec = gdn_spec(device, torch.float32)
    qlens, plens = [5, 1, 9, 1], [0, 7, 3, 2]
    ctx, _ = ragged_ctx(qlens, plens, device)
    c = 40
    x = torch.randn(sum(qlens), c, device=device)
    w = torch.randn(c, 4, device=device)
    state = torch.randn(4, c, 3, device=device)
    state_ref = state.clone()
    out = causal_conv1d(x, w, state, ctx.cu_seqlens_q, ctx.context_lens, ctx.state_slots, ctx.token_state_slots,
                        block_c=16)
    want = ReferenceGdnImpl(spec).conv(x, w, state_ref, ctx)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, state_ref)


def test_gdn_recurrent_ragged_with_state(device):
    from bi_core.kernels.gdn_recurrent import gdn_recurrent

    spec = gdn_spec(device, torch.float32)
    qlens, plens = [3, 1, 6], [0, 4, 2]
    ctx, _ = ragged_ctx(qlens, plens, device)
    ctx.is_recurrent_host = [True] * 3
    t = sum(qlens)
    q, k = torch.randn(t, 2, 16, device=device), torch.randn(t, 2, 16, device=device)
    v = torch.randn(t, 4, 32, device=device)
    g, beta = -torch.rand(t, 4, device=device), torch.rand(t, 4, device=device)
    state = torch.randn(3, 4, 16, 32, device=device)
    state_ref = state.clone()
    out = gdn_recurrent(q, k, v, g, beta, state, ctx.cu_seqlens_q, ctx.context_lens, ctx.state_slots,
                        ctx.token_state_slots, block_v=16)
    want = ReferenceGdnImpl(spec).delta_rule(q, k, v, g, beta, state_ref, ctx)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, state_ref, atol=1e-5, rtol=1e-5)


def test_gdn_ring_keeps_the_state_after_every_token(device):
    """Speculative layout: ring of 4 slots per sequence; slot (L + t + 1) % 4 gets the state after
    token t, in the conv and the recurrent kernels, equal to running the tokens one by one."""
    from bi_core.kernels.conv1d import causal_conv1d
    from bi_core.kernels.gdn_recurrent import gdn_recurrent

    ring, past, n = 4, 5, 3
    _, ctx = build_context([[0] * n], [past], [[0]], [1], [True], block_size=16, device=device, ring=ring)
    assert ctx.state_slots_host == [1 * ring + past % ring]
    assert ctx.token_state_slots_host == [ring + (past + t + 1) % ring for t in range(n)]
    q, k = torch.randn(n, 2, 16, device=device), torch.randn(n, 2, 16, device=device)
    v, g, beta = torch.randn(n, 4, 32, device=device), -torch.rand(n, 4, device=device), torch.rand(n, 4, device=device)
    x, w = torch.randn(n, 24, device=device), torch.randn(24, 4, device=device)
    state, conv = torch.randn(2 * ring, 4, 16, 32, device=device), torch.randn(2 * ring, 24, 3, device=device)
    s_one, c_one = state.clone(), conv.clone()
    gdn_recurrent(q, k, v, g, beta, state, ctx.cu_seqlens_q, ctx.context_lens, ctx.state_slots,
                  ctx.token_state_slots, per_token=True, block_v=16)
    causal_conv1d(x, w, conv, ctx.cu_seqlens_q, ctx.context_lens, ctx.state_slots, ctx.token_state_slots,
                  per_token=True, block_c=8)
    for t in range(n):  # one token at a time (decode steps) reach the same states
        _, c1 = build_context([[0]], [past + t], [[0]], [1], [True], block_size=16, device=device, ring=ring)
        gdn_recurrent(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], s_one, c1.cu_seqlens_q,
                      c1.context_lens, c1.state_slots, c1.token_state_slots, per_token=True, block_v=16)
        causal_conv1d(x[t:t + 1], w, c_one, c1.cu_seqlens_q, c1.context_lens, c1.state_slots, c1.token_state_slots,
                      per_token=True, block_c=8)
        slot = ctx.token_state_slots_host[t]
        assert torch.equal(state[slot], s_one[slot]) and torch.equal(conv[slot], c_one[slot])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear(device, dtype):
    from bi_core.kernels.gemm import linear

    for m in (1, 5, 70):
        x = torch.randn(m, 200, device=device, dtype=dtype)
        w = torch.randn(72, 200, device=device, dtype=dtype) / 14
        want = x.float() @ w.float().T
        assert rel(linear(x, w), want) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_mixed_prefill_decode(device, dtype):
    from bi_core.kernels.attention import make_tiles, paged_attention, tokens_per_tile

    hq, hkv, d = 4, 2, 32
    qlens, plens = [20, 1, 7, 1], [0, 30, 18, 3]
    ctx, nblocks = ragged_ctx(qlens, plens, device)
    t = sum(qlens)
    kc = torch.randn(nblocks, 16, hkv, d, device=device, dtype=dtype)
    vc = torch.randn(nblocks, 16, hkv, d, device=device, dtype=dtype)
    q, k, v = (torch.randn(t, h, d, device=device, dtype=dtype) for h in (hq, hkv, hkv))
    spec = AttentionSpec(dtype=dtype, device=device, num_heads=hq, num_kv_heads=hkv, head_dim=d, scale=d**-0.5)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    want = ReferenceAttentionImpl(spec).forward(q, k, v, kc_ref, vc_ref, ctx)
    write_kv(k, v, kc, vc, ctx.slot_mapping)
    seqs, starts = make_tiles(qlens, tokens_per_tile(hq, hkv), device)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, kc, vc, ctx.block_tables, ctx.context_lens, ctx.cu_seqlens_q, seqs, starts, d**-0.5, out=out)
    assert rel(out, want) < (2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_topk_and_fused_moe(device):
    from bi_core.kernels.moe import fused_moe
    from bi_core.kernels.topk import softmax_topk

    t, e, k, h, i = 13, 8, 2, 64, 32
    logits = torch.randn(t, e, device=device)
    logits[0, 3] = logits[0, 5] = 10.0  # a tie: the lower id must come first
    w, ids = softmax_topk(logits, k)
    w_ref, ids_ref = ReferenceTopKImpl(k).forward(logits)
    assert torch.equal(ids, ids_ref) and ids[0].tolist() == [3, 5]
    torch.testing.assert_close(w, w_ref)
    x = torch.randn(t, h, device=device)
    w13 = torch.randn(e, 2 * i, h, device=device) / 8
    w2 = torch.randn(e, h, i, device=device) / 6
    got = fused_moe(x, w, ids, w13, w2)
    want = ReferenceMoEImpl().forward(x, w, ids, w13, w2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_sampler(device):
    from bi_core.kernels.sampling import sample

    logits = torch.randn(6, 20000, device=device)  # three vocabulary chunks
    logits[2, 17] = logits[2, 15000] = 50.0  # greedy tie across chunks -> lower index
    seeds = torch.tensor([11, 12, 13, 14, 15, 16], device=device)
    greedy = torch.zeros(6, device=device)
    tokens, lse = sample(logits, seeds, greedy)
    assert tokens.tolist() == logits.argmax(-1).tolist() and tokens[2] == 17
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1), atol=1e-4, rtol=1e-5)
    hot = torch.ones(6, device=device)
    a, _ = sample(logits, seeds, hot)
    b, _ = sample(logits[3:4], seeds[3:4], hot[3:4])
    c, _ = sample(logits, seeds + 100, hot)
    assert a[3] == b[0] and a.tolist() != c.tolist()
