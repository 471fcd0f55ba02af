"""The reference Gated DeltaNet: chunked and recurrent forms agree, state carries across calls."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bi_core.backends.reference.gdn import chunk_delta_rule, l2norm, recurrent_delta_rule
from bi_core.ops.gdn import GdnSpec
from bi_core.runtime.batch import build_context


def inputs(h=3, t=150, dk=16, dv=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(h, t, dk, generator=g)) * dk**-0.5
    k = l2norm(torch.randn(h, t, dk, generator=g))
    v = torch.randn(h, t, dv, generator=g)
    decay = -torch.rand(h, t, generator=g)
    beta = torch.rand(h, t, generator=g)
    return q, k, v, decay, beta, torch.randn(h, dk, dv, generator=g)


def test_chunk_equals_recurrent_in_fp32():
    q, k, v, g, b, s0 = inputs()
    o1, s1 = recurrent_delta_rule(q, k, v, g, b, s0)
    o2, s2 = chunk_delta_rule(q, k, v, g, b, s0)
    torch.testing.assert_close(o1, o2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s1, s2, atol=1e-5, rtol=1e-5)


def test_recurrent_split_calls_are_bitwise_one_call():
    q, k, v, g, b, s0 = inputs(t=20)
    o, s = recurrent_delta_rule(q, k, v, g, b, s0)
    oa, sa = recurrent_delta_rule(q[:, :7], k[:, :7], v[:, :7], g[:, :7], b[:, :7], s0)
    ob, sb = recurrent_delta_rule(q[:, 7:], k[:, 7:], v[:, 7:], g[:, 7:], b[:, 7:], sa)
    assert torch.equal(torch.cat([oa, ob], 1), o) and torch.equal(sb, s)


def test_recurrent_bf16_state_rounds_after_every_token():
    """A state stored in bf16 between steps: one call over T tokens equals T one-token calls that
    each start from the stored (rounded) state; carrying fp32 across tokens does not (control)."""
    q, k, v, g, b, s0 = inputs(t=12)
    s0 = s0.to(torch.bfloat16).float()
    o, s = recurrent_delta_rule(q, k, v, g, b, s0, stored_dtype=torch.bfloat16)
    steps, st = [], s0
    for t in range(12):
        ot, st = recurrent_delta_rule(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], b[:, t:t + 1], st)
        steps.append(ot)
        st = st.to(torch.bfloat16).float()  # what the cache keeps
    assert torch.equal(torch.cat(steps, 1), o) and torch.equal(s, st)
    o_fp32, _ = recurrent_delta_rule(q, k, v, g, b, s0)
    assert not torch.equal(o_fp32, o)


def test_conv_with_state_matches_full_conv():
    from bi_core.backends.reference.gdn import ReferenceGdnImpl

    spec = GdnSpec(dtype=torch.float32, device=torch.device("cpu"), num_k_heads=1, num_v_heads=1, head_k_dim=2,
                   head_v_dim=2, conv_kernel=4)
    impl = ReferenceGdnImpl(spec)
    x = torch.randn(11, 6)
    w = torch.randn(6, 4)
    state = torch.zeros(2, 6, 3)
    expected = F.silu(F.conv1d(x.T[None], w[:, None], padding=3, groups=6)[0, :, :11].T)
    _, ctx = build_context([[0] * 5], [0], [[0]], [1], [False], block_size=16, device=torch.device("cpu"))
    first = impl.conv(x[:5], w, state, ctx)
    _, ctx = build_context([[0] * 6], [5], [[0]], [1], [False], block_size=16, device=torch.device("cpu"))
    second = impl.conv(x[5:], w, state, ctx)
    torch.testing.assert_close(torch.cat([first, second]), expected)
    assert torch.equal(state[1], x[-3:].T)
