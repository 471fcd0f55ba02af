"""The trainer's gradients, against autograd in float64: of each op's reference impl (the reference
backend's code, another implementation than the mathematics the backward differentiates; for
attention its arithmetic written out, as its cache writes are not differentiable), and of
transformers' own Qwen3.5 model for the whole policy (per-op backward and checkpointed layers)."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config
from hf_fixtures import make_hf_model, save_checkpoint

from bi_core import EngineConfig
from bi_core.backends.reference.attention import ReferenceAttentionImpl, split_qkv
from bi_core.backends.reference.gdn import ReferenceGdnImpl
from bi_core.backends.reference.moe import ReferenceMoEImpl
from bi_core.backends.reference.norm import rms_norm_1p
from bi_core.ops.gdn import GdnWeights
from bi_core.train import PolicyModel
from bi_core.train.ops import TrainAttention, TrainGdn, TrainMoE

PROMPTS = [[5, 17, 200, 3, 9, 41, 7, 8, 12, 99, 250, 1, 2, 60, 61, 62, 63, 64, 70], [11, 12, 13], [42]]
COMPLETIONS = [[7, 8, 9, 10, 11], [1, 1, 1, 2], [3, 250, 4, 5, 6, 7, 8, 9]]


def _config(path=None, preset="tiny-moe", chunk=8) -> EngineConfig:
    model = {"path": str(path), "random": None} if path is not None else {"random": {"preset": preset, "seed": 1}}
    return EngineConfig.from_dict(tiny_config(
        model={**model, "dtype": "float32", "device": "cpu", "max_model_len": 128}, backend="reference",
        scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 64, "prefill_chunk_size": chunk}))


def _close(ours: torch.Tensor, truth: torch.Tensor, name: str, tol: float = 2e-4) -> None:
    assert ours.shape == truth.shape, f"{name}: shape {tuple(ours.shape)}, expected {tuple(truth.shape)}"
    err = (ours.double() - truth.double()).norm() / truth.double().norm().clamp_min(1e-30)
    assert err < tol, f"{name}: relative error {err:.2e}"


def _hf_logprobs(hf, prompts, completions) -> list[torch.Tensor]:
    out = []
    for p, c in zip(prompts, completions):
        logits = hf(torch.tensor([p + c])).logits[0].double()
        lp = torch.log_softmax(logits[len(p) - 1:len(p) + len(c) - 1], dim=-1)
        out.append(lp.gather(1, torch.tensor(c)[:, None])[:, 0])
    return out


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("checkpoint", [True, False])
def test_whole_policy_gradients_match_transformers_in_float64(tmp_path, kind, checkpoint):
    hf = make_hf_model(kind)
    path = save_checkpoint(hf, tmp_path / kind, experts="fused")
    policy = PolicyModel.from_config(_config(path))
    policy.checkpoint_layers = checkpoint
    weights = [torch.randn(len(c), generator=torch.Generator().manual_seed(i)) for i, c in enumerate(COMPLETIONS)]
    ours = policy.token_logprobs(PROMPTS, COMPLETIONS)
    sum((w * lp).sum() for w, lp in zip(weights, ours)).backward()
    hf64 = hf.double()
    if kind == "moe":
        hf64.set_experts_implementation("eager")  # torch's grouped GEMM takes no float64
    theirs = _hf_logprobs(hf64, PROMPTS, COMPLETIONS)
    sum((w.double() * lp).sum() for w, lp in zip(weights, theirs)).backward()
    _close(torch.cat(ours).detach(), torch.cat(theirs).detach(), "logprobs", 1e-4)
    grads = dict(hf64.named_parameters())
    names = [n for n, _ in policy.named_parameters()]
    assert set(names) == {n for n in grads if n != "lm_head.weight" or not hf.config.tie_word_embeddings}
    for name, p in policy.named_parameters():  # float32 forward against float64: 2-4e-4 measured (MoE)
        _close(p.grad, grads[name].grad, name, 1e-3)


def _ctx(policy):
    return policy.plan(PROMPTS, COMPLETIONS)


def _module(policy, kind):
    return next(m for m in policy._engine.modules() if type(m).__name__ == kind)


def _check_op(wrapper, reference_forward, inputs, others=lambda dtype: ()) -> None:
    """Our op's gradients (float32) against autograd of ``reference_forward`` in float64."""
    xs = [x.clone().requires_grad_() if x.is_floating_point() else x for x in inputs]
    out = wrapper(*xs, *others(torch.float32))
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    (out.double() * probe).sum().backward()
    ys = [x.detach().double().requires_grad_() if x.is_floating_point() else x for x in inputs]
    (reference_forward(*ys, *others(torch.float64)) * probe).sum().backward()
    for i, (x, y) in enumerate(zip(xs, ys)):
        if x.is_floating_point():
            _close(x.grad, y.grad, f"input {i}")


def _eager_attention(spec, rope, qkv, q_norm, k_norm, spans, positions):
    """Gated attention written out (einsum scores, a causal mask, softmax, values): the reference
    impl's arithmetic without its cache, whose writes autograd does not follow."""
    q, gate, k, v = split_qkv(qkv, spec)
    q, k = rms_norm_1p(q, q_norm, spec.norm_eps), rms_norm_1p(k, k_norm, spec.norm_eps)
    cos, sin = rope.cos_sin(positions, qkv.dtype)
    q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
    group, out = spec.num_heads // spec.num_kv_heads, []
    for a, b in spans:
        keys, values = (x[a:b].repeat_interleave(group, dim=1) for x in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q[a:b], keys) * spec.scale
        scores = scores.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), values).reshape(b - a, -1))
    return torch.cat(out) * torch.sigmoid(gate)


def test_attention_gradient():
    policy = PolicyModel.from_config(_config())
    ctx, attn = _ctx(policy), _module(policy, "Attention")
    spec = attn.attn.spec
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(ctx.input_ids.shape[0], attn.qkv_proj.weight.shape[0], generator=gen)
    qn, kn = 0.1 * torch.randn(spec.head_dim, generator=gen), 0.1 * torch.randn(spec.head_dim, generator=gen)
    caches = lambda dt: tuple(torch.zeros(ctx.num_blocks, 16, spec.num_kv_heads, spec.head_dim, dtype=dt)
                              for _ in range(2))
    ours = TrainAttention(ReferenceAttentionImpl(spec), spec)
    _check_op(lambda q, a, b, kc, vc: ours.forward(q, a, b, kc, vc, ctx),
              lambda q, a, b, kc, vc: _eager_attention(spec, ours.rope, q, a, b, ctx.spans, ctx.positions),
              [qkv, qn, kn], caches)


def test_gdn_gradient():
    """The GDN op over the batch's calls (prompt chunks of 8, a one-token last chunk, completions)
    against the reference impl run call by call in float64, through its cache writes."""
    policy = PolicyModel.from_config(_config())
    ctx, gdn = _ctx(policy), _module(policy, "GatedDeltaNet")
    spec = gdn.gdn.spec
    gen = torch.Generator().manual_seed(1)
    proj = torch.randn(ctx.input_ids.shape[0], gdn.in_proj.weight.shape[0], generator=gen)
    w = [0.5 * torch.randn(spec.conv_dim, spec.conv_kernel, generator=gen),
         torch.empty(spec.num_v_heads).uniform_(1, 16, generator=gen).log(),
         torch.empty(spec.num_v_heads).uniform_(-1, 1, generator=gen),
         1 + 0.1 * torch.randn(spec.head_v_dim, generator=gen)]
    n = len(ctx.spans)

    def caches(dt):
        return (torch.zeros(n, spec.conv_dim, spec.conv_kernel - 1, dtype=dt),
                torch.zeros(n, spec.num_v_heads, spec.head_v_dim, spec.head_k_dim, dtype=dt))

    def reference(p, *rest):
        *ws, conv, state = rest
        out = torch.zeros(p.shape[0], spec.value_dim, dtype=p.dtype)
        for call in ctx.gdn:
            out = out.index_copy(0, call.rows, ReferenceGdnImpl(spec).forward(
                p[call.rows], GdnWeights(*ws), conv, state, call.ctx))
        return out

    ours = TrainGdn(ReferenceGdnImpl(spec), spec)
    _check_op(lambda p, *rest: ours.forward(p, GdnWeights(*rest[:4]), rest[4], rest[5], ctx), reference,
              [proj, *w], caches)


def test_moe_and_router_gradients():
    policy = PolicyModel.from_config(_config())
    moe = _module(policy, "SparseMoE")
    gen = torch.Generator().manual_seed(2)
    t, h = 11, moe.w13.shape[2]
    x = torch.randn(t, h, generator=gen)
    logits = torch.randn(t, moe.num_experts, generator=gen)
    w13 = torch.randn(moe.w13.shape, generator=gen) / h**0.5
    w2 = torch.randn(moe.w2.shape, generator=gen) / moe.w2.shape[2] ** 0.5
    shared = torch.randn(t, generator=gen)
    weights, ids = moe.topk.forward(logits)
    ours = TrainMoE(ReferenceMoEImpl(), moe.experts.spec)
    _check_op(lambda *a: ours.forward(a[0], a[1], ids, *a[2:]),
              lambda *a: ReferenceMoEImpl().forward(a[0], a[1], ids, *a[2:]), [x, weights.detach(), w13, w2, shared])
    from bi_core.backends.reference.topk import ReferenceTopKImpl

    _check_op(lambda lg: moe.topk.forward(lg)[0],
              lambda lg: ReferenceTopKImpl(moe.topk.impl.top_k).forward(lg)[0], [logits])


def test_linear_norm_and_logprob_gradients():
    from bi_core.backends.reference.linear import ReferenceLinearImpl
    from bi_core.backends.reference.norm import ReferenceRMSNormImpl
    from bi_core.backends.reference.sampling import ReferenceSamplerImpl
    from bi_core.train.ops import HeadLogprobFn, TrainLinear, TrainNorm

    gen = torch.Generator().manual_seed(3)
    x, r = torch.randn(9, 64, generator=gen), torch.randn(9, 64, generator=gen)
    w, w2 = torch.randn(96, 64, generator=gen) / 8, 0.1 * torch.randn(64, generator=gen)
    for silu_mul in (False, True):
        spec = type("S", (), {"weight_format": "dense", "silu_mul": silu_mul})()
        ours = TrainLinear(ReferenceLinearImpl(silu_mul), spec)
        _check_op(ours.forward, ReferenceLinearImpl(silu_mul).forward, [x, w])
    norm = TrainNorm(ReferenceRMSNormImpl(1e-6), type("S", (), {"eps": 1e-6})())
    _check_op(norm.forward, ReferenceRMSNormImpl(1e-6).forward, [x, w2])
    _check_op(lambda *a: sum(norm.forward_add(*a)), lambda *a: sum(ReferenceRMSNormImpl(1e-6).forward_add(*a)),
              [x, r, w2])
    head, targets = torch.randn(300, 64, generator=gen) / 8, torch.randint(0, 300, (9,), generator=gen)
    for t in (1.0, 0.7):
        _check_op(lambda h, hw, t=t: HeadLogprobFn.apply(ReferenceLinearImpl(), ReferenceSamplerImpl(), t, h, hw, targets),
                  lambda h, hw, t=t: torch.log_softmax(h @ hw.t() / t, dim=-1).gather(1, targets[:, None])[:, 0],
                  [x, head])


def test_moe_mathematics_grouped_and_per_expert_agree():
    """The MoE backward's two forms (``grouped_mm`` in bf16, as on a GPU; one expert at a time,
    float32 and float64 here): the same outputs and gradients up to bf16 rounding."""
    from bi_core.train import math

    if math._GROUPED_MM is None:
        pytest.skip("torch.nn.functional.grouped_mm needs torch >= 2.10")
    gen = torch.Generator().manual_seed(4)
    t, k, e, h, i = 40, 4, 9, 64, 32  # e: 8 routed experts + the shared one, stacked last
    ids = torch.stack([torch.randperm(e - 1, generator=gen)[:k] for _ in range(t)])
    inputs = [torch.randn(t, h, generator=gen), torch.rand(t, k, generator=gen),
              torch.randn(e, 2 * i, h, generator=gen) / h**0.5, torch.randn(e, h, i, generator=gen) / i**0.5,
              torch.randn(t, generator=gen)]

    def run(dtype):
        xs = [x.to(dtype).requires_grad_() for x in inputs]
        out = math.moe(xs[0], xs[1], ids, *xs[2:])
        grads = torch.autograd.grad(out.float().square().sum(), xs)
        return [out.float(), *(g.float() for g in grads)]

    for grouped, per_expert in zip(run(torch.bfloat16), run(torch.float32)):
        scale = per_expert.abs().max()
        assert (grouped - per_expert).abs().max() <= 0.05 * scale
