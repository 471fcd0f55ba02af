"""Each invariant kernel gives row r bitwise the same at many batch sizes and under row
permutations (torch.equal), and each has a negative control that must show a difference."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
SIZES = (1, 2, 3, 7, 8, 16, 64, 255, 256, 1024)


def rows_invariant(fn, make, sizes=SIZES) -> bool:
    """fn(batch) -> out; the first m rows and a permuted batch must match the largest batch bitwise."""
    full = make(max(sizes))
    ref = fn(full)
    for m in sizes:
        if not torch.equal(fn(full[:m])[:m], ref[:m]):
            return False
    perm = torch.randperm(full.shape[0], device=full.device)
    return torch.equal(fn(full[perm]), ref[perm])


# (N, K): split-K counts 8, 4, 2, 4, 4, 4, 1, 1 (the 35B-A3B out_proj, router+shared gate, lm_head ...)
GEMM_SHAPES = [(2048, 4096), (4096, 4096), (8192, 2048), (512, 2048), (257, 2048), (1, 2048), (12352, 2048),
               (248320, 2048)]


@pytest.mark.parametrize("n,k", GEMM_SHAPES)
def test_gemm_invariant_and_cublas_is_not(n, k):
    from bi_core.kernels.gemm import linear

    torch.manual_seed(n + k)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    make = lambda m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    sizes = SIZES if n < 100000 else (1, 3, 64, 256)
    assert rows_invariant(lambda x: linear(x, w), make, sizes)
    ref = make(1)  # matches the reference within bf16 tolerance
    torch.testing.assert_close(linear(ref, w).float(), ref.float() @ w.float().T, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("n,k", [(2048, 4096), (512, 2048), (4096, 4096)])  # split 8, 4, 4
def test_gemm_inline_splits_equal_split_programs(n, k):
    """Large M runs a split GEMM INLINE (one program adds its tile's splits in order; from 512 rows
    with TMA tiles, ``_gemm_tma_kernel``): every row must be bitwise what the split programs +
    ordered fix-up give, and a large batch that takes
    the inline path must still equal its rows computed alone (M=1)."""
    from bi_core.kernels.gemm import gemm_config, linear

    torch.manual_seed(k)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    x = torch.randn(8192, k, device="cuda", dtype=torch.bfloat16)
    assert gemm_config(8192, n, k)["INLINE"] and not gemm_config(1, n, k)["INLINE"]
    for m in (1, 70, 1024, 8192):
        cfg = gemm_config(m, n, k)
        split_cfg, inline_cfg = {**cfg, "INLINE": False, "TMA": False}, {**cfg, "INLINE": True}  # TMA from 512 rows
        assert torch.equal(linear(x[:m], w, config=split_cfg), linear(x[:m], w, config=inline_cfg))
    full = linear(x, w)
    assert all(torch.equal(linear(x[i:i + 1], w), full[i:i + 1]) for i in (0, 1, 777, 8191))


@pytest.mark.parametrize("n,k", [(3584, 1024), (12288, 4096)])  # split 2 and 1
def test_gemm_silu_mul_invariant(n, k):
    from bi_core.backends.reference.linear import silu_and_mul
    from bi_core.kernels.gemm import linear

    w = torch.randn(2 * n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    make = lambda m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    assert rows_invariant(lambda x: linear(x, w, silu_mul=True), make)
    x = make(5)
    want = silu_and_mul(x @ w.T)  # cuBLAS GEMM, then torch silu-and-mul: the same rounding steps
    assert float((linear(x, w, silu_mul=True).float() - want.float()).norm() / want.float().norm()) < 1e-2


def test_cublas_negative_control():
    """cuBLAS (the default backend's linear) changes row bits with M at this shape on Hopper."""
    torch.manual_seed(0)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    assert not rows_invariant(lambda x: x @ w.T, lambda m: torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16))


def test_norms_invariant():
    from bi_core.kernels.norm import gated_rms_norm, rms_norm

    w = 0.1 * torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    make = lambda m: torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
    assert rows_invariant(lambda x: rms_norm(x, w, 1e-6), make)
    assert rows_invariant(lambda x: rms_norm(x, w, 1e-6, residual=x.flip(1))[0], make)
    wg = 1 + 0.1 * torch.randn(128, device="cuda", dtype=torch.bfloat16)
    make_g = lambda m: torch.randn(m, 2, 128, device="cuda", dtype=torch.bfloat16)
    assert rows_invariant(lambda x: gated_rms_norm(x[:, 0], x[:, 1], wg, 1e-6), make_g)


def test_harness_negative_control():
    """The harness itself sees a row that depends on other rows (a batch-wide reduction)."""
    make = lambda m: torch.randn(m, 4096, device="cuda", dtype=torch.float32)
    assert not rows_invariant(lambda x: x - x.sum(0, keepdim=True) / 7, make)


def moe_weights(e, h, i, shared):
    router = torch.randn(e + shared, h, device="cuda", dtype=torch.bfloat16) / h**0.5
    w13 = torch.randn(e + shared, 2 * i, h, device="cuda", dtype=torch.bfloat16) / h**0.5
    w2 = torch.randn(e + shared, h, i, device="cuda", dtype=torch.bfloat16) / i**0.5
    return router, w13, w2


@pytest.mark.parametrize("e,k,h,i", [(64, 8, 1024, 256), (256, 8, 2048, 512)])
def test_topk_and_moe_invariant(e, k, h, i):
    """Routing (one Triton program; 1024 tokens x 9 slots sort in three chunks), the grouped GEMMs
    with the SiLU-and-mul epilogue and the combine with the shared expert."""
    from bi_core.kernels.moe import fused_moe
    from bi_core.kernels.topk import softmax_topk

    router, w13, w2 = moe_weights(e, h, i, shared=True)
    full = torch.randn(1024, h, device="cuda", dtype=torch.bfloat16)
    logits = full @ router.T  # router via torch here: the invariance of topk + MoE only

    def moe(rows):
        wts, ids = softmax_topk(logits[rows, :e], k)
        return fused_moe(full[rows], wts, ids, w13, w2, logits[rows, e])

    every = torch.arange(1024, device="cuda")
    ref = moe(every)
    for m in SIZES:
        assert torch.equal(moe(every[:m]), ref[:m]), m
    perm = torch.randperm(1024, device="cuda")
    assert torch.equal(moe(perm), ref[perm])


def test_moe_negative_control():
    """Per-expert cuBLAS GEMMs (the reference MoE on CUDA) change a token's bits with how many
    tokens its expert receives."""
    from bi_core.backends.reference.moe import ReferenceMoEImpl

    torch.manual_seed(1)
    e, h, i = 4, 4096, 2048
    _, w13, w2 = moe_weights(e, h, i, shared=False)
    x = torch.randn(1024, h, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, e, (1024, 1), device="cuda")
    wts = torch.ones(1024, 1, device="cuda")
    ref = ReferenceMoEImpl().forward(x, wts, ids, w13, w2)
    assert any(not torch.equal(ReferenceMoEImpl().forward(x[:m], wts[:m], ids[:m], w13, w2), ref[:m])
               for m in (1, 7, 64, 256))


def _ragged(query_lens, past_lens, recurrent=None, block_size=16, ring=1, slots=None):
    from bi_core.runtime.batch import build_context

    blocks, nxt = [], 0
    for q, p in zip(query_lens, past_lens):
        n = -(-(q + p) // block_size)
        blocks.append(list(range(nxt, nxt + n)))
        nxt += n
    if recurrent is None:
        recurrent = [q == 1 and p > 0 for q, p in zip(query_lens, past_lens)]
    _, ctx = build_context([[0] * q for q in query_lens], past_lens, blocks,
                           list(range(len(query_lens))) if slots is None else slots, recurrent,
                           block_size=block_size, device=torch.device("cuda"), ring=ring)
    return ctx, nxt


def _attention(hq=16, hkv=2, d=256):
    from bi_core.backends.cuda_common.attention import TritonPagedAttentionImpl
    from bi_core.ops.attention import AttentionSpec

    spec = AttentionSpec(dtype=torch.bfloat16, device=torch.device("cuda"), num_heads=hq, num_kv_heads=hkv,
                         head_dim=d, scale=d**-0.5, rotary_dim=64, rope_theta=1e7, norm_eps=1e-6)
    norms = [0.1 * torch.randn(d, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    return TritonPagedAttentionImpl(spec), norms


def test_attention_row_invariant_across_batches_and_forms():
    """The fused gated attention (q/k norm, RoPE, KV write, fixed-split attention, gate): a decode
    row of sequence 0 gives the same bits alone, beside prefills of other lengths and as the last
    row of its own verify tile (a prompt tile's row agrees to bf16 tolerance: another kernel);
    1024 decode rows at mixed KV lengths give row r's bits at every batch size and under
    permutation; prompt rows alike, and in chunks of any size."""
    torch.manual_seed(0)
    impl, (qn, kn) = _attention()
    hq, hkv, d, page = 16, 2, 256, 16
    width = 2 * hq * d + 2 * hkv * d
    kc = torch.randn(40960, page, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)

    def run(qlens, plens, qkv, recurrent=None, caches=(kc, vc)):
        ctx, _ = _ragged(qlens, plens, recurrent)
        return impl.forward(qkv, qn, kn, caches[0], caches[1], ctx)

    qkv_all = torch.randn(4000, width, device="cuda", dtype=torch.bfloat16)
    alone = run([1], [700], qkv_all[:1])
    mixes = [([1, 300, 1, 57], [700, 0, 40, 1000]), ([1] * 64, [700] + [900] * 63), ([1, 2000], [700, 0])]
    for qlens, plens in mixes:
        assert torch.equal(run(qlens, plens, qkv_all[: sum(qlens)])[:1], alone)
    # the same token at position 700 as the last row of a 5-token verify tile and of a prefill tile
    # (both write positions 696..700 first, so the decode row is recomputed on that KV)
    qkv5 = torch.cat([torch.randn(4, width, device="cuda", dtype=torch.bfloat16), qkv_all[:1]])
    verify = run([5], [696], qkv5, [True])[4:5]
    prefill_tile = run([5], [696], qkv5, [False])[4:5]
    decode = run([1], [700], qkv5[4:])
    assert torch.equal(verify, decode)
    assert (prefill_tile.float() - decode.float()).abs().max() <= 2e-2 * decode.float().abs().max()
    # decode rows of 1024 sequences: the first m alone vs all, and permuted (pages permuted with them)
    plens = torch.randint(1, 1200, (1024,), generator=torch.Generator().manual_seed(1)).tolist()
    q_dec = torch.randn(1024, width, device="cuda", dtype=torch.bfloat16)
    full = run([1] * 1024, plens, q_dec)
    for m in SIZES[:-1]:
        assert torch.equal(run([1] * m, plens[:m], q_dec[:m]), full[:m]), m
    perm = torch.randperm(1024).tolist()
    starts = [0]
    for p in plens:
        starts.append(starts[-1] + -(-(p + 1) // page))
    kc_p, vc_p, nxt = kc.clone(), vc.clone(), 0
    for i in perm:
        n_i = starts[i + 1] - starts[i]
        kc_p[nxt:nxt + n_i], vc_p[nxt:nxt + n_i] = kc[starts[i]:starts[i + 1]], vc[starts[i]:starts[i + 1]]
        nxt += n_i
    permuted = run([1] * 1024, [plens[i] for i in perm], q_dec[perm], caches=(kc_p, vc_p))
    assert torch.equal(permuted, full[perm])
    # a prefill of 300 tokens alone vs packed with others
    p_alone = run([300], [0], qkv_all[1:301])
    assert torch.equal(run([300, 1, 1, 57], [0, 700, 40, 1000], qkv_all[1:360])[:300], p_alone)
    # a 3,000-token prompt in one chunk, then its last 1,100 tokens again as a chunk after 1,900
    # (other tiles, another masked/unmasked split): the same bits
    whole = run([3000], [0], qkv_all[:3000])
    assert torch.equal(run([1100], [1900], qkv_all[1900:3000]), whole[1900:])


def _paged_attention(hq: int, pages: int):
    """``run(qlens, past_lens, qkv, recurrent)`` over random pages of 16 tokens, 2 KV heads of 256."""
    impl, (qn, kn) = _attention(hq=hq)
    kc = torch.randn(pages, 16, 2, 256, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)

    def run(qlens, plens, qkv, recurrent=None):
        ctx, _ = _ragged(qlens, plens, recurrent)
        return impl.forward(qkv, qn, kn, kc, vc, ctx)

    return run, 2 * hq * 256 + 2 * 2 * 256


# 4, 8 and 16 query heads per KV head (0.8B / 9B, 35B-A3B, 122B / 397B): 64 MMA rows
@pytest.mark.parametrize("hq,tokens", [(8, 16), (16, 8), (32, 4)])
def test_verify_rows_at_64_mma_rows_equal_decode_rows(hq, tokens, monkeypatch):
    """A verify tile of 64 MMA rows (tokens x query heads per KV head) gives each row the bits of
    the one-token decode step at its position: what lets MTP verify 3 drafts on the 122B-A10B and
    397B-A17B shapes (16 heads per KV head) and exact scoring run 8 tokens a step on 35B-A3B and 16
    on 9B / 0.8B (``EXACT_DECODE_ROWS``). Past lengths inside a KV chunk, across a chunk boundary and across
    the 16-chunk run boundary. Negative control: the same verify with the split kernel on 4 warps
    (a warpgroup MMA) has other bits."""
    import bi_core.kernels.attention as attn

    torch.manual_seed(0)
    run, width = _paged_attention(hq, 2000)
    first = None
    for past in (700, 254, 4094):
        rows = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
        verify = run([tokens], [past], rows, [True])
        first = (rows, verify) if first is None else first
        for t in range(tokens):
            assert torch.equal(verify[t:t + 1], run([1], [past + t], rows[t:t + 1])), (past, t)
    monkeypatch.setattr(attn, "DECODE_WARPS", 4)
    assert not torch.equal(run([tokens], [700], first[0], [True]), first[1])


def test_attention_long_rows_merge_in_runs_invariantly():
    """Decode rows past MERGE_RUN KV chunks (``edge`` = MERGE_RUN x KV_SPLIT tokens) merge their
    chunks in runs of MERGE_RUN first (``_merge_runs_kernel``): a row at 20,000 tokens gives the
    same bits on every call, alone and first in a batch of rows at edge - 1 .. 30,000 tokens; a
    4-token verify across the run boundary (positions edge - 2 .. edge + 1: MERGE_RUN and
    MERGE_RUN + 1 chunks) gives each row its decode bits, and so does one at 19,997..20,000."""
    from bi_core.kernels.attention import KV_SPLIT, MERGE_RUN

    torch.manual_seed(0)
    run, width = _paged_attention(16, 12000)
    edge = MERGE_RUN * KV_SPLIT
    assert ((edge - 1) // KV_SPLIT + 1, edge // KV_SPLIT + 1) == (MERGE_RUN, MERGE_RUN + 1)
    assert 20000 > 2 * edge  # the 20,000-token row merges two runs or more
    qkv = torch.randn(64, width, device="cuda", dtype=torch.bfloat16)
    alone = run([1], [20000], qkv[:1])
    for _ in range(3):
        assert torch.equal(run([1], [20000], qkv[:1]), alone)
    batch = run([1] * 8, [20000, 5000, 30000, edge - 1, edge, 12345, 2 * edge - 1, 25000], qkv[:8])
    assert torch.equal(batch[:1], alone)
    for past in (edge - 2, 19997):
        rows = qkv[8:12]
        verify = run([4], [past], rows, [True])
        for t in range(4):
            assert torch.equal(verify[t:t + 1], run([1], [past + t], rows[t:t + 1])), (past, t)


def test_decode_attention_long_rows_same_bits_every_call():
    """The decode kernels alone (split, run merge, merge) on 64 rows at 20,000..40,000 tokens:
    20 calls, each with a fresh output and workspace, give the first call's bits. A race between
    warps or programs shows here and in no audit (short contexts never merge in runs). Negative
    control: without the barrier in ``_merge_runs_kernel`` (00768dc's parent) this test fails
    (benchmarks section 24)."""
    import bi_core.kernels.attention as attn

    hq, hkv, d, page, b = 16, 2, 256, 16, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    ctx_lens = torch.randint(20000, 40000, (b,), generator=torch.Generator().manual_seed(5)).tolist()
    pages = [-(-c // page) for c in ctx_lens]
    kc = torch.randn(sum(pages), page, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(kc.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    bt = torch.zeros(b, max(pages), dtype=torch.int32, device="cuda")
    first_page = 0
    for i, n in enumerate(pages):
        bt[i, :n] = torch.arange(first_page, first_page + n, dtype=torch.int32)
        first_page += n
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    gate = torch.randn(b, 2 * hq * d, device="cuda", dtype=torch.bfloat16, generator=g)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")
    cu = torch.arange(b + 1, dtype=torch.int32, device="cuda")
    dec = torch.arange(b, dtype=torch.int64, device="cuda")
    chunks = sum(-(-c // attn.KV_SPLIT) for c in ctx_lens)
    outs = []
    for _ in range(20):
        out = torch.full((b, hq * d), float("nan"), device="cuda", dtype=torch.bfloat16)
        attn.decode_attention(q, kc, vc, gate, out, bt, ctx, cu, dec, d**-0.5, 1, 128, chunks)
        outs.append(out)
    assert not outs[0].isnan().any()
    differing = [int((o != outs[0]).sum()) for o in outs[1:]]
    assert not any(differing), f"elements differing from the first call, per call: {differing}"


def test_attention_negative_control():
    """FlashInfer's default decode split depends on the batch size (the default backend's path)."""
    flashinfer = pytest.importorskip("flashinfer")
    torch.manual_seed(0)
    hq, hkv, d, page, kv = 16, 2, 256, 16, 4096
    kc = torch.randn(256 * kv // page, page, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(256, hq, d, device="cuda", dtype=torch.bfloat16)
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")

    def run(b):
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
        per = kv // page
        indptr = torch.arange(0, (b + 1) * per, per, dtype=torch.int32, device="cuda")
        indices = torch.arange(b * per, dtype=torch.int32, device="cuda")
        last = torch.full((b,), page, dtype=torch.int32, device="cuda")
        wrapper.plan(indptr, indices, last, hq, hkv, d, page, q_data_type=torch.bfloat16)
        return wrapper.run(q[:b], (kc, vc))

    ref = run(1)
    assert any(not torch.equal(run(b)[:1], ref) for b in (8, 64, 256))


def _gdn(n, ring=1):
    from bi_core.ops.gdn import GdnWeights

    c, hv, dk, dv = 8192, 32, 128, 128
    proj = torch.randn(n, c + hv * dv + 2 * hv, device="cuda", dtype=torch.bfloat16)
    weights = GdnWeights(conv1d=(torch.randn(c, 4, device="cuda") / 2).to(torch.bfloat16),
                         A_log=torch.rand(hv, device="cuda") * 2, dt_bias=torch.randn(hv, device="cuda"),
                         norm=(1 + 0.1 * torch.randn(dv, device="cuda")).to(torch.bfloat16))
    conv0 = torch.randn(n * ring, c, 3, device="cuda", dtype=torch.bfloat16)
    s0 = torch.randn(n * ring, hv, dv, dk, device="cuda")  # S transposed, as the cache stores it
    return proj, weights, conv0, s0


def _gdn_decode(proj, weights, conv, state, ctx):
    from bi_core.kernels.gdn_decode import gdn_decode

    out = torch.full((proj.shape[0], 32 * 128), float("nan"), dtype=proj.dtype, device="cuda")
    return gdn_decode(proj, weights.conv1d, weights.A_log, weights.dt_bias, weights.norm, conv, state,
                      ctx.cu_seqlens_q, ctx.context_lens, ctx.state_slots, ctx.token_state_slots, ctx.recurrent_ids,
                      out, num_k_heads=16, head_k_dim=128, eps=1e-6, per_token=ctx.state_ring > 1)


def test_gdn_decode_invariant():
    """The fused GDN decode kernel (conv, gates, delta rule, gated norm): row r's output, state and
    conv window are the same whatever the batch; a 4-token verify equals 4 decode steps."""
    torch.manual_seed(0)
    n = 1024
    proj, weights, conv0, s0 = _gdn(n)

    def step(rows):
        m = rows.shape[0]
        ctx, _ = _ragged([1] * m, [5] * m)
        ctx.state_slots.copy_(rows)  # row r always uses state slot r, wherever it sits in the batch
        ctx.token_state_slots.copy_(rows)
        conv, state = conv0.clone(), s0.clone()
        return _gdn_decode(proj[rows], weights, conv, state, ctx), state[rows], conv[rows]

    every = torch.arange(n, device="cuda")
    ref = step(every)
    for m in SIZES[:-1]:
        assert all(torch.equal(a, b[:m]) for a, b in zip(step(every[:m]), ref)), m
    perm = torch.randperm(n, device="cuda")
    assert all(torch.equal(a, b[perm]) for a, b in zip(step(perm), ref))
    # verify form: 4 tokens through the ring in one call == 4 one-token steps
    ring = 4
    proj4, weights4, conv4, s4 = _gdn(4, ring)
    ctx, _ = _ragged([4], [6], [True], ring=ring, slots=[0])
    c_all, s_all = conv4.clone(), s4.clone()
    out = _gdn_decode(proj4, weights4, c_all, s_all, ctx)
    c_one, s_one = conv4.clone(), s4.clone()
    for t in range(4):
        ctx1, _ = _ragged([1], [6 + t], [True], ring=ring, slots=[0])
        o1 = _gdn_decode(proj4[t:t + 1], weights4, c_one, s_one, ctx1)
        assert torch.equal(o1, out[t:t + 1])
    assert torch.equal(c_all, c_one) and torch.equal(s_all, s_one)


def test_gdn_negative_control():
    """Choosing the GDN form by batch shape breaks invariance: fla's chunked kernel and the fused
    recurrent kernel give different bits for the same 4 tokens (why verify must be recurrent)."""
    pytest.importorskip("fla")
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from bi_core.backends.cuda_common.fla_tuning import pin_first
    from bi_core.backends.reference.gdn import gates, split_proj
    from bi_core.kernels.conv1d import causal_conv1d
    from bi_core.ops.gdn import GdnSpec

    pin_first()  # as the invariant backend does (an unpinned first call autotunes for minutes)
    torch.manual_seed(0)
    proj, weights, conv0, s0 = _gdn(4)
    ctx, _ = _ragged([4], [8], [True])
    rec = _gdn_decode(proj, weights, conv0.clone(), s0.clone(), ctx)
    spec = GdnSpec(dtype=torch.bfloat16, device=torch.device("cuda"), num_k_heads=16, num_v_heads=32,
                   head_k_dim=128, head_v_dim=128, conv_kernel=4)
    mixed, z, b, a = split_proj(proj, spec)
    mixed = causal_conv1d(mixed, weights.conv1d, conv0.clone(), ctx.cu_seqlens_q, ctx.context_lens, ctx.state_slots,
                          ctx.token_state_slots)
    q, k, v = torch.split(mixed, [2048, 2048, 4096], dim=-1)
    g, beta = gates(a, b, weights)
    o, _ = chunk_gated_delta_rule(q.reshape(1, 4, 16, 128), k.reshape(1, 4, 16, 128), v.reshape(1, 4, 32, 128),
                                  g=g[None], beta=beta[None], scale=128**-0.5,
                                  initial_state=s0[:1].transpose(-1, -2).contiguous(),  # fla: [N, Hv, Dk, Dv]
                                  output_final_state=True, use_qk_l2norm_in_kernel=True,
                                  cu_seqlens=torch.tensor([0, 4], device="cuda"))
    from bi_core.kernels.norm import gated_rms_norm

    chunked = gated_rms_norm(o[0].to(torch.bfloat16).reshape(-1, 128), z.reshape(-1, 128), weights.norm,
                             1e-6).reshape(4, -1)
    assert not torch.equal(rec, chunked)


def test_sampler_invariant():
    from bi_core.kernels.sampling import sample

    logits = torch.randn(1024, 248320, device="cuda", dtype=torch.bfloat16)
    keys = torch.randint(0, 2**62, (1024,), device="cuda")
    temps = torch.rand(1024, device="cuda") + 0.1
    temps[::3] = 0.0  # greedy rows too
    ref = sample(logits, keys, temps)
    for m in SIZES[:-1]:
        got = sample(logits[:m], keys[:m], temps[:m])
        assert all(torch.equal(a, b[:m]) for a, b in zip(got, ref)), m
    perm = torch.randperm(1024, device="cuda")
    got = sample(logits[perm], keys[perm], temps[perm])
    assert all(torch.equal(a, b[perm]) for a, b in zip(got, ref))


def test_sampler_negative_control():
    """A generator shared by the batch (torch.multinomial) makes a row's draw depend on its place."""
    probs = torch.softmax(torch.randn(256, 1000, device="cuda"), -1)

    def draw(p):
        gen = torch.Generator(device="cuda").manual_seed(0)
        return torch.multinomial(p, 1, generator=gen)[:, 0]

    assert not rows_invariant(draw, lambda m: probs[:m], sizes=(1, 64, 256))
