"""Each Triton kernel against the reference backend on fresh random inputs (outputs poisoned)."""

from __future__ import annotations

import pytest
import torch

from bi_core.backends.reference.attention import ReferenceAttentionImpl
from bi_core.backends.reference.gdn import ReferenceGdnImpl
from bi_core.backends.reference.linear import ReferenceLinearImpl
from bi_core.backends.reference.moe import ReferenceMoEImpl
from bi_core.backends.reference.norm import ReferenceRMSNormImpl, gated_rms_norm
from bi_core.backends.reference.topk import ReferenceTopKImpl
from bi_core.ops.attention import AttentionSpec
from bi_core.ops.gdn import GdnSpec, GdnWeights
from bi_core.runtime.batch import build_context


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def ragged_ctx(query_lens, past_lens, device, block_size=16, recurrent=None, ring=1, slots=None):
    blocks, nxt = [], 0
    for q, p in zip(query_lens, past_lens):
        n = -(-(q + p) // block_size)
        blocks.append(list(range(nxt, nxt + n)))
        nxt += n + 1  # leave holes so pages are not contiguous
    if recurrent is None:
        recurrent = [q == 1 and p > 0 for q, p in zip(query_lens, past_lens)]
    ids, ctx = build_context([[0] * q for q in query_lens], past_lens, blocks,
                             slots if slots is not None else list(range(len(query_lens))), recurrent,
                             block_size=block_size, device=device, ring=ring)
    return ctx, nxt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(device, dtype):
    from bi_core.kernels.norm import gated_rms_norm as triton_gated
    from bi_core.kernels.norm import rms_norm

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
    got, want = triton_gated(x, g, w + 1, 1e-6), gated_rms_norm(x, g, w + 1, 1e-6)
    # three bf16 roundings in a row: the interpreter truncates each (a ~1% bias); the GPU rounds
    gated_tol = 3e-2 if (dtype == torch.bfloat16 and device.type == "cpu") else tol
    assert rel(got, want) < gated_tol


def test_gated_rms_norm_per_head_of_strided_rows(device):
    """``head_dim``: per-head norms of strided [T, heads * head_dim] rows (the in_proj output's z
    columns), written into strided output rows, bitwise what the reshaped copy gives."""
    from bi_core.kernels.norm import gated_rms_norm

    t, heads, dv = 5, 8, 32  # 8 heads: a program normalises a row's 8 heads
    proj = torch.randn(t, 3 * heads * dv, device=device, dtype=torch.bfloat16)
    x, z = proj[:, :heads * dv], proj[:, heads * dv: 2 * heads * dv]  # row stride 3 * heads * dv
    w = 1 + 0.1 * torch.randn(dv, device=device, dtype=torch.bfloat16)
    want = gated_rms_norm(x.reshape(-1, dv), z.reshape(-1, dv), w, 1e-6).reshape(t, heads * dv)
    out = torch.full((t + 2, heads * dv), float("nan"), device=device, dtype=torch.bfloat16)
    gated_rms_norm(x, z, w, 1e-6, head_dim=dv, out=out[1:t + 1])
    assert torch.equal(out[1:t + 1], want) and out[0].isnan().all() and out[-1].isnan().all()
    assert torch.equal(gated_rms_norm(x, z, w, 1e-6, head_dim=dv), want)


def gdn_spec(device, dtype):
    return GdnSpec(dtype=dtype, device=device, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=32,
                   conv_kernel=4)


def gdn_inputs(spec, num_tokens, num_slots, device, dtype):
    proj = torch.randn(num_tokens, spec.conv_dim + spec.value_dim + 2 * spec.num_v_heads, device=device, dtype=dtype)
    weights = GdnWeights(conv1d=(torch.randn(spec.conv_dim, 4, device=device) / 2).to(dtype),
                         A_log=torch.rand(spec.num_v_heads, device=device) * 2,
                         dt_bias=torch.randn(spec.num_v_heads, device=device),
                         norm=(1 + 0.1 * torch.randn(spec.head_v_dim, device=device)).to(dtype))
    conv = torch.randn(num_slots, spec.conv_dim, 3, device=device, dtype=dtype)
    state = torch.randn(num_slots, spec.num_v_heads, spec.head_v_dim, spec.head_k_dim, device=device)
    return proj, weights, conv, state


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv1d_token_runs_change_no_bit(device, dtype):
    """Spreading a sequence's tokens over programs of ``chunk`` tokens (3, 4, 5, 64) gives
    the outputs and stored windows of one program per sequence, bit for bit: new and continuing
    sequences, runs shorter than the window and sequences shorter than a run."""
    from bi_core.kernels.conv1d import causal_conv1d

    qlens, plens = [5, 1, 9, 2, 70], [0, 7, 3, 0, 4]
    ctx, _ = ragged_ctx(qlens, plens, device)
    c = 40
    x = torch.randn(sum(qlens), c, device=device).to(dtype)
    w = torch.randn(c, 4, device=device).to(dtype)
    state = torch.randn(len(qlens), c, 3, device=device).to(dtype)
    runs = []
    for chunk in (None, 3, 4, 5, 64):
        s = state.clone()
        kw = {} if chunk is None else {"max_tokens": max(qlens), "chunk": chunk}
        out = causal_conv1d(x, w, s, ctx.cu_seqlens_q, ctx.context_lens, ctx.state_slots, ctx.token_state_slots,
                            block_c=16, **kw)
        runs.append((out, s))
    for out, s in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(s, runs[0][1])
    assert not torch.equal(runs[0][1], state)


@pytest.mark.parametrize("chunk", [None, 4])
def test_conv1d_valid_rows_keep_the_real_window(device, chunk):
    """A sequence padded at its end (a mixed graph's last prompt piece): with ``valid`` the real
    rows' outputs and the stored window are those of the sequence without its padding, bit for
    bit, for a continuing and a new sequence, a real part shorter than the window included."""
    from bi_core.kernels.conv1d import causal_conv1d

    c, pad = 40, 9
    for real, past in ((6, 5), (2, 5), (7, 0)):
        x = torch.randn(real + pad, c, device=device)
        w = torch.randn(c, 4, device=device)
        state = torch.randn(3, c, 3, device=device)
        slots, token_slots = torch.tensor([1], device=device), torch.full((real + pad,), 2, device=device)
        results = []
        for n, valid in ((real, None), (real + pad, torch.tensor([real], device=device))):
            s = state.clone()
            kw = {} if chunk is None else {"max_tokens": n, "chunk": chunk}
            out = causal_conv1d(x[:n], w, s, torch.tensor([0, n], device=device), torch.tensor([past + n], device=device),
                                slots, token_slots[:n], block_c=16, valid=valid, **kw)
            results.append((out[:real], s))
        assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
        assert not torch.equal(results[0][1], state)


@pytest.mark.parametrize("chunk", [None, 4])
def test_conv1d_prompt_rows_under_a_state_ring_keep_the_final_window(device, chunk):
    """Speculative decoding gives every token its own state slot (a ring). A prompt's next step
    reads only its last token's slot, so the prefill path stores the final window there (no
    ``per_token``), which is also what lets a padded prompt piece (``valid``) replay a graph: the
    outputs and that slot's window are ``per_token``'s bit for bit, and the other ring slots are
    left alone (negative control: ``per_token`` writes them)."""
    from bi_core.kernels.conv1d import causal_conv1d

    ring, c, pad = 4, 40, 5
    qlens, plens = [9, 6], [0, 3]
    ctx, _ = ragged_ctx(qlens, plens, device, recurrent=[False, False], ring=ring)
    x = torch.randn(sum(qlens), c, device=device)
    w = torch.randn(c, 4, device=device)
    state = torch.randn(len(qlens) * ring, c, 3, device=device)
    args = (ctx.cu_seqlens_q, ctx.context_lens, ctx.state_slots, ctx.token_state_slots)
    per_token, final = state.clone(), state.clone()
    want = causal_conv1d(x, w, per_token, *args, per_token=True, block_c=16)
    kw = {} if chunk is None else {"max_tokens": max(qlens), "chunk": chunk}
    got = causal_conv1d(x, w, final, *args, block_c=16, **kw)
    assert torch.equal(got, want)
    last = ctx.token_state_slots[ctx.cu_seqlens_q[1:].long() - 1].long()
    assert torch.equal(final[last], per_token[last]) and not torch.equal(final[last], state[last])
    others = [i for i in range(state.shape[0]) if i not in last.tolist()]
    assert torch.equal(final[others], state[others]) and not torch.equal(per_token[others], state[others])
    # the second prompt padded at its end, as a graph's last piece: the same outputs and window
    n = qlens[1]
    rows = x[qlens[0]:]
    padded = torch.cat([rows, torch.randn(pad, c, device=device)])
    slots = ctx.token_state_slots[qlens[0]:]
    slots = torch.cat([slots, slots[-1:].expand(pad)])
    s = state.clone()
    out = causal_conv1d(padded, w, s, torch.tensor([0, n + pad], device=device),
                        ctx.context_lens[1:] + pad, ctx.state_slots[1:], slots, block_c=16,
                        valid=torch.tensor([n], device=device), **kw)
    assert torch.equal(out[:n], want[qlens[0]:]) and torch.equal(s[last[1]], per_token[last[1]])


def run_gdn_decode(spec, proj, weights, conv, state, ctx, out=None):
    from bi_core.kernels.gdn_decode import gdn_decode

    out = torch.full((proj.shape[0], spec.value_dim), float("nan"), dtype=proj.dtype, device=proj.device) \
        if out is None else out
    return gdn_decode(proj, weights.conv1d, weights.A_log, weights.dt_bias, weights.norm, conv, state,
                      ctx.cu_seqlens_q, ctx.context_lens, ctx.state_slots, ctx.token_state_slots, ctx.recurrent_ids,
                      out, num_k_heads=spec.num_k_heads, head_k_dim=spec.head_k_dim, eps=1e-6,
                      per_token=ctx.state_ring > 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gdn_decode_matches_reference(device, dtype):
    """The fused decode kernel (conv, gates, delta rule, gated norm) against the reference mixer
    core, decode rows and multi-token recurrent (verify-like) rows, new and continuing sequences."""
    torch.manual_seed(4)
    spec = gdn_spec(device, dtype)
    qlens, plens = [3, 1, 1, 4], [0, 4, 9, 2]
    ctx, _ = ragged_ctx(qlens, plens, device, recurrent=[True] * 4)
    proj, weights, conv, state = gdn_inputs(spec, sum(qlens), 4, device, dtype)
    conv_ref, state_ref = conv.clone(), state.clone()
    out = run_gdn_decode(spec, proj, weights, conv, state, ctx)
    want = ReferenceGdnImpl(spec).forward(proj, weights, conv_ref, state_ref, ctx)
    # seven bf16 roundings in a row (conv, silu, beta, o, the norm's three): the interpreter truncates
    # each (dev/notebook.md, tolerances), the GPU rounds to nearest even
    tol = (5e-2 if device.type == "cpu" else 2e-2) if dtype == torch.bfloat16 else 1e-4
    assert rel(out, want) < tol
    assert rel(state, state_ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    torch.testing.assert_close(conv, conv_ref)  # windows are copies of inputs: exact


def test_gdn_decode_ring_keeps_the_state_after_every_token(device):
    """Speculative layout: ring of 4 slots per sequence; slot (L + t + 1) % 4 gets the state after
    token t (conv window and recurrent state), bitwise equal to running the tokens one by one."""
    spec = gdn_spec(device, torch.float32)
    ring, past, n = 4, 5, 3
    ctx, _ = ragged_ctx([n], [past], device, recurrent=[True], ring=ring, slots=[1])
    assert ctx.state_slots_host == [1 * ring + past % ring]
    assert ctx.token_state_slots_host == [ring + (past + t + 1) % ring for t in range(n)]
    proj, weights, conv, state = gdn_inputs(spec, n, 2 * ring, device, torch.float32)
    s_one, c_one = state.clone(), conv.clone()
    out = run_gdn_decode(spec, proj, weights, conv, state, ctx)
    for t in range(n):  # one token at a time (decode steps) reach the same states and outputs
        c1, _ = ragged_ctx([1], [past + t], device, recurrent=[True], ring=ring, slots=[1])
        o1 = run_gdn_decode(spec, proj[t:t + 1], weights, c_one, s_one, c1)
        slot = ctx.token_state_slots_host[t]
        assert torch.equal(state[slot], s_one[slot]) and torch.equal(conv[slot], c_one[slot])
        assert torch.equal(out[t:t + 1], o1)


def test_gdn_decode_per_token_matches_reference(device):
    """A verify-shaped call (ring of 4 slots per sequence, 4, 3 and 2 tokens, continuing and new
    sequences, value heads sharing a key head) against the reference in fp32: outputs, and the
    state and conv window stored after every token."""
    torch.manual_seed(6)
    spec = gdn_spec(device, torch.float32)
    ring, qlens, plens = 4, [4, 3, 2], [5, 0, 11]
    ctx, _ = ragged_ctx(qlens, plens, device, recurrent=[True] * 3, ring=ring, slots=[2, 0, 1])
    proj, weights, conv, state = gdn_inputs(spec, sum(qlens), 3 * ring, device, torch.float32)
    state0, conv_ref, state_ref = state.clone(), conv.clone(), state.clone()
    out = run_gdn_decode(spec, proj, weights, conv, state, ctx)
    want = ReferenceGdnImpl(spec).forward(proj, weights, conv_ref, state_ref, ctx)
    assert rel(out, want) < 1e-4
    assert len(set(ctx.token_state_slots_host)) == sum(qlens)  # one slot per token
    for slot in ctx.token_state_slots_host:
        assert rel(state[slot], state_ref[slot]) < 1e-5 and not torch.equal(state[slot], state0[slot])
    assert torch.equal(conv, conv_ref)  # windows are copies of inputs: exact


def test_gdn_decode_speed_knobs_change_no_bit(device):
    """The launch shape (split conv + recurrence, or fused per key head) and the split conv's
    BLOCK_C and warps are speed knobs (the conv is element-wise per channel, the recurrence per
    value head the same code): outputs, states and conv windows are bitwise the same for each
    setting, a partly masked last block included (decode and verify-like rows, new and
    continuing sequences). The recurrence's
    warp count is not one in general: it can change the layout a small state tile's row sums run
    in (it did at this test's 16 x 32 heads on an H200)."""
    from bi_core.kernels.gdn_decode import gdn_decode

    torch.manual_seed(5)
    spec = gdn_spec(device, torch.bfloat16)
    qlens, plens = [3, 1, 1, 4], [0, 4, 9, 2]
    ctx, _ = ragged_ctx(qlens, plens, device, recurrent=[True] * 4)
    proj, weights, conv, state = gdn_inputs(spec, sum(qlens), 4, device, torch.bfloat16)
    runs = []
    shapes = [{"split": True, "BLOCK_C": b, "conv_warps": w} for b, w in ((16, 1), (64, 2), (128, 4))]
    for cfg in shapes + [{"split": False}]:  # split: conv_dim 192 in 12, 3 and 2 blocks; then fused
        c, s = conv.clone(), state.clone()
        out = torch.empty((proj.shape[0], spec.value_dim), dtype=proj.dtype, device=device)
        gdn_decode(proj, weights.conv1d, weights.A_log, weights.dt_bias, weights.norm, c, s, ctx.cu_seqlens_q,
                   ctx.context_lens, ctx.state_slots, ctx.token_state_slots, ctx.recurrent_ids, out,
                   num_k_heads=spec.num_k_heads, head_k_dim=spec.head_k_dim, eps=1e-6, per_token=False,
                   config=cfg)
        runs.append((out, s, c))
    for out, s, c in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(s, runs[0][1]) and torch.equal(c, runs[0][2])
    assert not torch.equal(runs[0][1], state)  # the states moved


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_recurrent_row_equals_one_token_steps(device, state_dtype):
    """Exact scoring runs a whole continuation as one recurrent row: outputs and final state must
    be bitwise those of one-token decode steps, also when the state is stored in bf16 (rounded
    after every token, as each step stores it; the negative control of that rounding is in
    tests/unit/test_gdn_reference.py)."""
    spec = gdn_spec(device, torch.bfloat16)
    past, n = 6, 9
    proj, weights, conv, state = gdn_inputs(spec, n, 2, device, torch.bfloat16)
    state = state.to(state_dtype)
    s_row, c_row, s_one, c_one = state.clone(), conv.clone(), state.clone(), conv.clone()
    ctx, _ = ragged_ctx([n], [past], device, recurrent=[True], slots=[1])
    out = run_gdn_decode(spec, proj, weights, c_row, s_row, ctx)
    steps = []
    for t in range(n):
        c1, _ = ragged_ctx([1], [past + t], device, recurrent=[True], slots=[1])
        steps.append(run_gdn_decode(spec, proj[t:t + 1], weights, c_one, s_one, c1))
    assert torch.equal(out, torch.cat(steps)) and torch.equal(s_row[1], s_one[1]) and torch.equal(c_row[1], c_one[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(72, 200), (40, 2048)])  # the second splits K in 8
def test_linear(device, dtype, n, k):
    from bi_core.kernels.gemm import gemm_config, linear

    assert gemm_config(1, 40, 2048)["SPLIT_K"] == 8
    w = torch.randn(n, k, device=device, dtype=dtype) / k**0.5
    w2 = torch.randn(2 * n, k, device=device, dtype=dtype) / k**0.5
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for m in (1, 5, 70):
        x = torch.randn(m, k, device=device, dtype=dtype)
        assert rel(linear(x, w), x.float() @ w.float().T) < tol
        want = ReferenceLinearImpl(silu_mul=True).forward(x.float(), w2.float())
        assert rel(linear(x, w2, silu_mul=True), want) < 2 * tol


def test_linear_inline_splits_equal_split_programs(device):
    """The INLINE path (one program adds a tile's splits in split order) gives the split programs'
    bits (with their ordered fix-up); the large-M config takes it, M=1 does not."""
    from bi_core.kernels.gemm import gemm_config, linear

    n, k = 40, 2048
    assert gemm_config(16384, 2048, 4096)["INLINE"] and not gemm_config(1, 2048, 4096)["INLINE"]
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
    x = torch.randn(33, k, device=device, dtype=torch.bfloat16)
    cfg = gemm_config(33, n, k)
    assert cfg["SPLIT_K"] == 8
    split = linear(x, w, config={**cfg, "INLINE": False})
    inline = linear(x, w, config={**cfg, "INLINE": True})
    assert torch.equal(split, inline)
    assert rel(inline, x.float() @ w.float().T) < 1e-2


def attention_inputs(device, dtype, hq=4, hkv=2, d=32, rot=8):
    spec = AttentionSpec(dtype=dtype, device=device, num_heads=hq, num_kv_heads=hkv, head_dim=d, scale=d**-0.5,
                         rotary_dim=rot, rope_theta=1e4, norm_eps=1e-6)
    q_norm, k_norm = (0.1 * torch.randn(d, device=device, dtype=dtype) for _ in range(2))
    return spec, q_norm, k_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rope_write(device, dtype):
    from bi_core.backends.cuda_common.attention import _inv_freq
    from bi_core.backends.reference.attention import Rope, split_qkv
    from bi_core.backends.reference.norm import rms_norm_1p
    from bi_core.kernels.qk_norm_rope import qk_norm_rope_write

    spec, q_norm, k_norm = attention_inputs(device, dtype)
    ctx, nblocks = ragged_ctx([5, 1], [0, 300], device)
    qkv = torch.randn(6, 2 * 4 * 32 + 2 * 2 * 32, device=device, dtype=dtype)
    kc = torch.full((nblocks, 16, 2, 32), float("nan"), device=device, dtype=dtype)
    vc = kc.clone()
    q = qk_norm_rope_write(qkv, q_norm, k_norm, _inv_freq(spec), ctx.positions, ctx.slot_mapping, kc, vc, 4, 1e-6, 8)
    rope = Rope(8, 1e4, device)
    q_ref, _, k_ref, v_ref = split_qkv(qkv, spec)
    cos, sin = rope.cos_sin(ctx.positions, dtype)
    q_ref = rope.apply(rms_norm_1p(q_ref, q_norm, 1e-6), cos, sin)
    k_ref = rope.apply(rms_norm_1p(k_ref, k_norm, 1e-6), cos, sin)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert rel(q, q_ref) < tol
    flat_k, flat_v = kc.view(-1, 2, 32)[ctx.slot_mapping], vc.view(-1, 2, 32)[ctx.slot_mapping]
    assert rel(flat_k, k_ref) < tol and torch.equal(flat_v, v_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_attention_mixed_prefill_decode_verify(device, dtype):
    """Prefill chunks, decode rows with KV longer than one split, and a multi-token recurrent
    (verify) sequence in one step, against the reference."""
    from bi_core.backends.cuda_common.attention import TritonPagedAttentionImpl
    from bi_core.kernels.attention import KV_SPLIT

    spec, q_norm, k_norm = attention_inputs(device, dtype)
    qlens, plens = [20, 1, 7, 1, 3], [0, KV_SPLIT + 40, 18, 3, 2 * KV_SPLIT - 1]
    ctx, nblocks = ragged_ctx(qlens, plens, device, recurrent=[False, True, False, True, True])
    t = sum(qlens)
    kc = torch.randn(nblocks, 16, 2, 32, device=device, dtype=dtype)
    vc = torch.randn(nblocks, 16, 2, 32, device=device, dtype=dtype)
    qkv = torch.randn(t, 2 * 4 * 32 + 2 * 2 * 32, device=device, dtype=dtype)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    want = ReferenceAttentionImpl(spec).forward(qkv, q_norm, k_norm, kc_ref, vc_ref, ctx)
    impl = TritonPagedAttentionImpl(spec)
    assert [len(x) for x in (impl.prepare(ctx).dec_seqs, impl.prepare(ctx).tile_seq)] == [3, 2]
    out = impl.forward(qkv, q_norm, k_norm, kc, vc, ctx)
    assert rel(out, want) < (2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_decode_rows_over_shared_pages_read_more_keys_than_the_cache_holds(device):
    """Sequences sharing prompt pages (n samples, prefix caching): together their contexts span
    more KV chunks than the cache holds; each must still get its own workspace partials."""
    from bi_core.backends.cuda_common.attention import TritonPagedAttentionImpl
    from bi_core.kernels.attention import KV_SPLIT

    spec, q_norm, k_norm = attention_inputs(device, torch.float32)
    past, n = 2 * KV_SPLIT + 5, 6
    pages = -(-(past + 1) // 16)
    blocks = [list(range(pages - 1)) + [pages - 1 + i] for i in range(n)]  # all but the last page shared
    _, ctx = build_context([[0]] * n, [past] * n, blocks, list(range(n)), [True] * n, block_size=16, device=device)
    kc = torch.randn(pages - 1 + n, 16, 2, 32, device=device)
    vc = torch.randn_like(kc)
    qkv = torch.randn(n, 2 * 4 * 32 + 2 * 2 * 32, device=device)
    assert n * past > kc.shape[0] * 16  # more keys read than the cache holds
    want = ReferenceAttentionImpl(spec).forward(qkv, q_norm, k_norm, kc.clone(), vc.clone(), ctx)
    out = TritonPagedAttentionImpl(spec).forward(qkv, q_norm, k_norm, kc, vc, ctx)
    assert rel(out, want) < 1e-5


def test_decode_form_and_prompt_form_agree(device):
    """A decode row (split programs + ordered merge over KV_SPLIT-key chunks of 32-key blocks) and the
    same row inside a prompt tile (one online softmax over 64-key blocks) at a KV length spanning
    three splits: the same attention to float tolerance, not the same bits (the forms' block
    edges differ; a token's form is fixed by its request, see kernels/attention.py)."""
    from bi_core.backends.cuda_common.attention import TritonPagedAttentionImpl
    from bi_core.kernels.attention import KV_SPLIT

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    spec, q_norm, k_norm = attention_inputs(device, dtype)
    n = 2 * KV_SPLIT + 30
    impl = TritonPagedAttentionImpl(spec)
    qkv = torch.randn(n, 2 * 4 * 32 + 2 * 2 * 32, device=device, dtype=dtype)
    ctx, nblocks = ragged_ctx([n], [0], device)
    kc = torch.zeros(nblocks, 16, 2, 32, device=device, dtype=dtype)
    vc = torch.zeros_like(kc)
    prefill = impl.forward(qkv, q_norm, k_norm, kc, vc, ctx)  # one prefill of n tokens
    ctx1, _ = ragged_ctx([1], [n - 1], device, recurrent=[True])
    decode = impl.forward(qkv[n - 1:], q_norm, k_norm, kc, vc, ctx1)  # its last token as a decode row
    assert impl.prepare(ctx1).dec_seqs.shape[0] == 1 and impl.prepare(ctx).dec_seqs.shape[0] == 0
    assert rel(decode, prefill[n - 1:]) < (2e-2 if dtype == torch.bfloat16 else 1e-6)


def test_align_routes_every_pair_once(device):
    from bi_core.kernels.moe import align

    for tokens, k, e, shared in ((1, 2, 8, True), (13, 2, 8, False), (600, 8, 64, True)):
        ids = torch.stack([torch.randperm(e, device=device)[:k] for _ in range(tokens)])
        r = align(ids, e + shared, shared)
        pairs = r.sorted_pairs.tolist()
        real = [p for p in pairs if p < r.num_pairs]
        assert sorted(real) == list(range(tokens * (k + shared)))
        for row, p in enumerate(pairs):
            if p < r.num_pairs:
                t, slot = divmod(p, r.slots)
                expert = e if slot == k else int(ids[t, slot])
                assert r.block_expert[row // r.block_m] == expert
        # stable within an expert: pairs in increasing order
        for b in range(r.block_expert.shape[0]):
            block = [p for p in pairs[b * r.block_m:(b + 1) * r.block_m] if p < r.num_pairs]
            assert block == sorted(block)


@pytest.mark.parametrize("shared", [False, True])
def test_topk_and_fused_moe(device, shared):
    from bi_core.kernels.moe import fused_moe
    from bi_core.kernels.topk import softmax_topk

    t, e, k, h, i = 13, 8, 2, 64, 32
    logits = torch.randn(t, e + 1, device=device)
    logits[0, 3] = logits[0, 5] = 10.0  # a tie: the lower id must come first
    w, ids = softmax_topk(logits[:, :e], k)  # a strided view, as the model passes it
    w_ref, ids_ref = ReferenceTopKImpl(k).forward(logits[:, :e])
    assert torch.equal(ids, ids_ref) and ids[0].tolist() == [3, 5]
    torch.testing.assert_close(w, w_ref)
    x = torch.randn(t, h, device=device)
    w13 = torch.randn(e + shared, 2 * i, h, device=device) / 8
    w2 = torch.randn(e + shared, h, i, device=device) / 6
    gate = logits[:, e] if shared else None
    got = fused_moe(x, w, ids, w13, w2, gate)
    want = ReferenceMoEImpl().forward(x, w, ids, w13, w2, gate)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared", [False, True])
def test_moe_per_pair_path_equals_sorted_path(device, shared, dtype):
    """Up to PAIR_TOKENS tokens the experts run per pair with the combine fused into the down
    GEMM: the same numbers as the sorted path (bitwise on the GPU; the interpreter's dot is
    numpy's, whose rounding may follow the tile's other rows, and it truncates to bf16)."""
    from bi_core.kernels.moe import PAIR_TOKENS, _moe_per_pair, _moe_sorted, fused_moe

    e, k, h, i = 8, 2, 64, 48
    w13 = (torch.randn(e + shared, 2 * i, h, device=device) / 8).to(dtype)
    w2 = (torch.randn(e + shared, h, i, device=device) / 6).to(dtype)
    for t in (1, 3, PAIR_TOKENS):
        x = torch.randn(t, h, device=device, dtype=dtype)
        ids = torch.stack([torch.randperm(e, device=device)[:k] for _ in range(t)])
        wts = torch.rand(t, k, device=device).softmax(-1)
        gate = torch.randn(t, device=device) if shared else None
        pair, sorted_ = _moe_per_pair(x, wts, ids, w13, w2, gate), _moe_sorted(x, wts, ids, w13, w2, gate)
        assert torch.equal(fused_moe(x, wts, ids, w13, w2, gate), pair)
        if device.type == "cuda":
            assert torch.equal(pair, sorted_)
        else:
            assert rel(pair, sorted_) < (1e-6 if dtype == torch.float32 else 1e-2)
        if dtype == torch.float32:
            want = ReferenceMoEImpl().forward(x, wts, ids, w13, w2, gate)
            torch.testing.assert_close(pair, want, atol=1e-5, rtol=1e-5)


def test_sampler(device):
    from bi_core.kernels.sampling import sample

    logits = torch.randn(6, 20000, device=device)  # three vocabulary chunks
    logits[2, 17] = logits[2, 15000] = 50.0  # greedy tie across chunks -> lower index
    seeds = torch.tensor([11, 12, 13, 14, 15, 16], device=device)
    greedy = torch.zeros(6, device=device)
    tokens, lse, packed = sample(logits, seeds, greedy)
    assert tokens.tolist() == logits.argmax(-1).tolist() and tokens[2] == 17
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1), atol=1e-4, rtol=1e-5)
    assert packed[:, 0].long().tolist() == tokens.tolist()
    torch.testing.assert_close(packed[:, 1].float(), torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0],
                               atol=1e-4, rtol=1e-5)
    hot = torch.ones(6, device=device)
    a = sample(logits, seeds, hot)[0]
    b = sample(logits[3:4], seeds[3:4], hot[3:4])[0]
    c = sample(logits, seeds + 100, hot)[0]
    assert a[3] == b[0] and a.tolist() != c.tolist()


def _align_by_torch(topk_ids, num_experts, shared, bm, max_rows):
    """The routing as torch ops (the path prefill took before ``moe._align_chunked``): a stable
    sort of the pairs by expert, each expert's rows padded to bm -> (sorted pairs, block experts)."""
    num_tokens, _ = topk_ids.shape
    ids = topk_ids
    if shared:
        ids = torch.cat([ids, torch.full((num_tokens, 1), num_experts - 1, dtype=ids.dtype, device=ids.device)], 1)
    flat = ids.reshape(-1)
    num_pairs = flat.shape[0]
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + bm - 1) // bm * bm
    padded_end = torch.cumsum(padded, 0)
    expert_of = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - (torch.cumsum(counts, 0) - counts)[expert_of]
    sorted_pairs = torch.full((max_rows,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs.scatter_(0, (padded_end - padded)[expert_of] + rank, order.to(torch.int32))
    block_expert = torch.searchsorted(padded_end, torch.arange(0, max_rows, bm, device=flat.device), right=True)
    return sorted_pairs, block_expert.to(torch.int32)


@pytest.mark.parametrize("tokens,k,e", [(1, 8, 256), (200, 4, 16), (400, 8, 64), (600, 8, 64), (1000, 8, 256)])
def test_align_paths_agree(device, tokens, k, e):
    """Both Triton routings give the torch sort's rows for the same pairs: up to SORT_CHUNK pairs
    one launch (a program per expert: one token over 257 experts, one chunk of pairs, several);
    past it two launches over chunks of ROUTE_CHUNK pairs (5,400 pairs: 6 chunks, the last
    partial; 9,000 over 257 experts). Each expert's blocks name it, and an empty block names
    num_experts (clamped: the one-launch path may name any id past the last expert)."""
    from bi_core.kernels.moe import SORT_CHUNK, align, max_rows_for

    ids = torch.stack([torch.randperm(e, device=device)[:k] for _ in range(tokens)])
    r = align(ids, e + 1, True)
    assert (r.num_pairs <= SORT_CHUNK) == (tokens <= 400)
    pairs, blocks = _align_by_torch(ids, e + 1, True, r.block_m, max_rows_for(r.num_pairs, e + 1, r.block_m))
    assert torch.equal(r.sorted_pairs, pairs)
    assert torch.equal(r.block_expert.clamp(max=e + 1), blocks.clamp(max=e + 1))
    if r.num_pairs > SORT_CHUNK:  # the chunked path names empty blocks exactly
        assert torch.equal(r.block_expert, blocks)
