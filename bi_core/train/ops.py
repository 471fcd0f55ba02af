"""The engine's op impls with a backward. Each wrapped call is an autograd Function whose forward
is the impl the engine runs (its kernels, its bits) and whose backward differentiates the op's
mathematics (``train/math.py``) recomputed from the saved inputs. ``TrainFactory`` wraps every impl
an op factory builds, so the engine's own model classes run a training forward unchanged.

Inside ``math_mode()`` (a layer's recomputation under activation checkpointing, ``train/policy.py``)
the wrappers compute the mathematics directly, under autograd: a checkpointed layer's backward
then costs what a per-op backward does, one recomputation in PyTorch, not a rerun of the kernels."""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator

import torch

from bi_core.backends.reference.attention import Rope
from bi_core.ops.activation import Fp8Activation
from bi_core.ops.gdn import GdnWeights
from bi_core.ops.moe import ExpertLora
from bi_core.ops.sampling import at_temperature
from bi_core.train import math

# set only while a checkpointed layer recomputes for its backward (``math_mode``): a context
# variable, not a module flag, so a forward in another thread is never switched by it
_MATH = contextvars.ContextVar("bi_core_train_math", default=False)


@contextlib.contextmanager
def math_mode() -> Iterator[None]:
    token = _MATH.set(True)
    try:
        yield
    finally:
        _MATH.reset(token)


def _call(forward_fn: Callable, math_fn: Callable, *inputs):
    """The op: its kernels with a recomputing backward, or (math mode) its mathematics."""
    if _MATH.get():
        return math_fn(*inputs)
    return Replay.apply(forward_fn, math_fn, *inputs)


class Replay(torch.autograd.Function):
    """``forward_fn(*inputs)`` (no autograd); the backward runs ``math_fn(*inputs)`` under autograd
    from the saved inputs and differentiates it. ``math_fn``'s outputs correspond to the first of
    ``forward_fn``'s; integer outputs are not differentiable."""

    @staticmethod
    def forward(ctx, forward_fn: Callable, math_fn: Callable, *inputs):
        ctx.math_fn = math_fn
        ctx.save_for_backward(*inputs)
        out = forward_fn(*inputs)
        for t in out if isinstance(out, tuple) else (out,):
            if not t.is_floating_point():
                ctx.mark_non_differentiable(t)
        return out

    @staticmethod
    def backward(ctx, *grads):
        needs = ctx.needs_input_grad[2:]
        return (None, None, *replay_grads(ctx.math_fn, ctx.saved_tensors, needs, grads))


def replay_grads(fn: Callable, inputs, needs, grads) -> list[torch.Tensor | None]:
    """Gradients of ``fn(*inputs)`` (recomputed under autograd) with respect to the inputs that
    ``needs`` marks, given the gradients of its outputs (None: that output got none)."""
    with torch.enable_grad():
        xs = [x.detach().requires_grad_() if n else x for x, n in zip(inputs, needs)]
        outs = fn(*xs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o is not None and o.requires_grad]
    wrt = [x for x, n in zip(xs, needs) if n]
    got = (torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
           if pairs and wrt else [None] * len(wrt))
    it = iter(got)
    return [next(it) if n else None for n in needs]


class LinearFn(torch.autograd.Function):
    """A dense ``x @ W.T`` through the impl; gradients in closed form (nothing recomputed)."""

    @staticmethod
    def forward(ctx, impl, x, weight):
        ctx.save_for_backward(x, weight)
        return impl.forward(x, weight)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g = g.to(x.dtype)
        gx = g @ w.to(g.dtype) if ctx.needs_input_grad[1] else None
        gw = (g.t() @ x).to(w.dtype) if ctx.needs_input_grad[2] else None
        return None, gx, gw


class TrainLinear:
    writes_into = False  # the model copies into wider buffers itself (a copy autograd sees)

    def __init__(self, impl, spec) -> None:
        self.impl, self.spec = impl, spec

    def forward(self, x, weight, weight_scale=None, x_fp8=None):
        if weight_scale is not None:  # block-FP8: the kernels on the quantized copy, gradients of the bf16 one
            return self._fp8(x, weight, weight_scale, x_fp8)
        if self.spec.silu_mul:
            return _call(self.impl.forward, math.silu_mul_linear, x, weight)
        if _MATH.get():
            return torch.nn.functional.linear(x, weight)
        return LinearFn.apply(self.impl, x, weight)

    def _fp8(self, x, weight, weight_scale, x_fp8):
        """``weight`` is the FP8 copy, ``weight.dense`` the bf16 weights it was quantized from
        (``PolicyLayer.engine_params``): the straight-through estimator differentiates the dense
        layer at those weights."""
        quantized = {} if x_fp8 is None else {"x_fp8": x_fp8}
        kernels = lambda x_, _dense: self.impl.forward(x_, weight, weight_scale, **quantized)
        mathematics = math.silu_mul_linear if self.spec.silu_mul else torch.nn.functional.linear
        return _call(kernels, mathematics, x, weight.dense)


def _parts(y) -> tuple[torch.Tensor, ...]:
    return (y.x, y.q, y.scale) if isinstance(y, Fp8Activation) else (y,)


def _joined(parts) -> torch.Tensor | Fp8Activation:
    parts = parts if isinstance(parts, tuple) else (parts,)
    return parts[0] if len(parts) == 1 else Fp8Activation(*parts)


class TrainLora:
    """The lora op (``ops/lora.py``): the engine's kernels on a copy of the base output (they add
    into it in place), the delta's mathematics in the backward; ``a`` and ``b`` are the stacks the
    policy builds from its adapter's A and B (``train/adapter.py``), so those get the gradients."""

    def __init__(self, impl, spec) -> None:
        self.impl, self.silu_mul = impl, spec.silu_mul

    def forward(self, y, x, a, b, slots, ranks=None):
        kernels = lambda y_, x_, a_, b_: self.impl.forward(y_.clone(), x_, a_, b_, slots, ranks)
        mathematics = lambda y_, x_, a_, b_: math.lora(y_, x_, a_, b_, slots, self.silu_mul)
        if self.silu_mul or not y._is_view():
            return _call(kernels, mathematics, y, x, a, b)
        # y is columns of a wider buffer (``Linear(out=...)``: official FP8's GDN in_proj | in_proj_ba),
        # which the caller reads: the sum goes back into it, as the engine's kernel adds in place
        # (from a copy, so the Function's saved input is not the tensor written)
        y.copy_(_call(kernels, mathematics, y.clone(), x, a, b))
        return y


class TrainNorm:
    def __init__(self, impl, spec) -> None:
        self.impl, self.eps = impl, spec.eps

    def forward(self, x, weight):
        return _joined(_call(lambda *a: _parts(self.impl.forward(*a)), functools.partial(math.norm, eps=self.eps),
                             x, weight))

    def forward_add(self, x, residual, weight):
        def kernels(x, r, w):
            y, total = self.impl.forward_add(x, r, w)
            return (total, *_parts(y))

        def mathematics(x, r, w):
            y, total = math.norm_add(x, r, w, self.eps)
            return total, y
        out = _call(kernels, mathematics, x, residual, weight)
        return _joined(tuple(out[1:])), out[0]


class TrainTopK:
    def __init__(self, impl, spec) -> None:
        self.impl = impl

    def forward(self, router_logits):
        if _MATH.get():  # the experts the kernels chose (ties included), weighted by the mathematics
            ids = self.impl.forward(router_logits.detach())[1]
            return math.topk_weights(router_logits, ids), ids
        return TopKFn.apply(self.impl, router_logits)


class TopKFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, impl, logits):
        weights, ids = impl.forward(logits)
        ctx.save_for_backward(logits, ids)
        ctx.mark_non_differentiable(ids)
        return weights, ids

    @staticmethod
    def backward(ctx, g, _):
        logits, ids = ctx.saved_tensors
        (gx,) = replay_grads(lambda x: math.topk_weights(x, ids), [logits], [True], [g])
        return None, gx


class TrainMoE:
    def __init__(self, impl, spec) -> None:
        self.impl, self.spec = impl, spec

    def forward(self, x, topk_weights, topk_ids, w13, w2, shared_logits=None, *, lora: ExpertLora | None = None,
                **fp8):
        shared = () if shared_logits is None else (shared_logits,)
        if lora is not None:  # (dense experts only: lora/experts.py refuses FP8 ones)
            return self._lora(x, topk_weights, topk_ids, w13, w2, shared_logits, lora)
        if not fp8:
            return _call(self.impl.forward, math.moe, x, topk_weights, topk_ids, w13, w2, *shared)
        # block-FP8 experts (``w13.dense``, ``w2.dense``: their bf16 weights, as TrainLinear._fp8)
        fp8 = {k: v for k, v in fp8.items() if v is not None}
        kernels = lambda x_, w_, ids_, _13, _2, *s_: self.impl.forward(x_, w_, ids_, w13, w2, *s_, **fp8)
        return _call(kernels, math.moe, x, topk_weights, topk_ids, w13.dense, w2.dense, *shared)

    def _lora(self, x, topk_weights, topk_ids, w13, w2, shared_logits, lora: ExpertLora):
        """The engine's kernels on the step's expert adapters; the backward differentiates
        ``math.moe_lora``, so the stacks (built from the policy's A and B) get gradients."""
        n = 4 if lora.shared is None else 8

        def split(rest):
            stacks, logits = rest[:n], rest[n:]
            return stacks[:4], (tuple(stacks[4:]) or None), (logits[0] if logits else None)

        def kernels(x_, w_, ids_, w13_, w2_, *rest):
            routed, sh, logits = split(rest)
            return self.impl.forward(x_, w_, ids_, w13_, w2_, logits,
                                     lora=ExpertLora(*routed, pairs=lora.pairs, shared=sh, slots=lora.slots))

        def mathematics(x_, w_, ids_, w13_, w2_, *rest):
            routed, sh, logits = split(rest)
            return math.moe_lora(x_, w_, ids_, w13_, w2_, logits, routed, lora.pairs, sh, lora.slots)
        stacks = (lora.a13, lora.b13, lora.a2, lora.b2, *(lora.shared or ()))
        logits = () if shared_logits is None else (shared_logits,)
        return _call(kernels, mathematics, x, topk_weights, topk_ids, w13, w2, *stacks, *logits)


class TrainAttention:
    """The attention op over the batch's one attention context (``TrainContext.attention``)."""

    def __init__(self, impl, spec) -> None:
        self.impl, self.spec = impl, spec
        self.decode_query_len = getattr(impl, "decode_query_len", None)
        self.rope = Rope(spec.rotary_dim, spec.rope_theta, spec.device)

    def forward(self, qkv, q_norm, k_norm, k_cache, v_cache, ctx, kv_scales=None):
        scales = {} if kv_scales is None else {"kv_scales": kv_scales}
        kernels = lambda q, a, b: self.impl.forward(q, a, b, k_cache, v_cache, ctx.attention, **scales)
        mathematics = lambda q, a, b: math.attention(self.spec, self.rope, q, a, b, ctx.spans, ctx.positions)
        return _call(kernels, mathematics, qkv, q_norm, k_norm)


class TrainGdn:
    """The GDN op over the batch's calls in order (prompt chunks, then the completions)."""

    def __init__(self, impl, spec) -> None:
        self.impl, self.spec = impl, spec

    def forward(self, proj, weights: GdnWeights, conv_state, state, ctx):
        def kernels(p, *w):
            out = torch.empty((p.shape[0], self.spec.value_dim), dtype=p.dtype, device=p.device)
            for call in ctx.gdn:
                out[call.rows] = self.impl.forward(p[call.rows], GdnWeights(*w), conv_state, state, call.ctx)
            return out
        mathematics = lambda p, *w: math.gdn(self.spec, p, GdnWeights(*w), ctx.spans)
        return _call(kernels, mathematics, proj, weights.conv1d, weights.A_log, weights.dt_bias, weights.norm)


class TrainSampler:
    """The sampler impl, whose ``logprobs_of`` gives the logprobs the engine reports (HeadLogprobFn)."""

    def __init__(self, impl, spec) -> None:
        self.impl = impl


HEAD_BLOCK = 512  # logits rows at once: a block's vocabulary-wide logits, never a whole batch's


class HeadLogprobFn(torch.autograd.Function):
    """The lm_head and the sampler's logprob of each target, ``HEAD_BLOCK`` rows at a time (the
    head computes a row from that row alone, so blocks change no bit, as in the engine's scoring);
    the backward recomputes each block's logits, so no batch-wide logits are ever kept."""

    @staticmethod
    def forward(ctx, head, sampler, temperature: float, hidden, weight, targets):
        """``temperature`` != 1: the logprobs a ``logprobs_mode="temperature"`` request reports
        (``ops.sampling.at_temperature``, then the sampler's arithmetic)."""
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature = temperature
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for a in range(0, hidden.shape[0], HEAD_BLOCK):
            logits = head.forward(hidden[a:a + HEAD_BLOCK], weight)
            if temperature != 1.0:
                logits = at_temperature(logits, torch.full((logits.shape[0],), temperature, dtype=torch.float32))
            out[a:a + HEAD_BLOCK] = sampler.logprobs_of(logits, targets[a:a + HEAD_BLOCK], 0).logprobs
        return out

    @staticmethod
    def backward(ctx, g):
        hidden, weight, targets = ctx.saved_tensors
        gh = torch.empty_like(hidden) if ctx.needs_input_grad[3] else None
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[4] else None
        for a in range(0, hidden.shape[0], HEAD_BLOCK):
            h, gb, t = hidden[a:a + HEAD_BLOCK], g[a:a + HEAD_BLOCK], targets[a:a + HEAD_BLOCK]
            t_ = ctx.temperature
            grad = torch.softmax(torch.nn.functional.linear(h, weight).float() / t_, dim=-1).mul_(-gb[:, None])
            grad.scatter_add_(1, t[:, None], gb[:, None].float())
            grad = (grad / t_).to(hidden.dtype)
            if gh is not None:
                gh[a:a + HEAD_BLOCK] = grad @ weight
            if gw is not None:
                gw += (grad.t() @ h).float()
        return None, None, None, gh, None if gw is None else gw.to(weight.dtype), None


WRAPPERS = {"linear": TrainLinear, "norm": TrainNorm, "topk": TrainTopK, "attention": TrainAttention,
            "gdn": TrainGdn, "sampling": TrainSampler, "lora": TrainLora,
            "moe": TrainMoE}


class TrainFactory:
    """An op factory whose impls train: the wrapped factory selects and builds each impl (its
    policy, its backend order, its refusals), this one wraps it (once per impl)."""

    def __init__(self, factory) -> None:
        self.inner, self.base = factory, factory.base
        self._wrapped: dict[int, object] = {}

    def build(self, op: str, spec):
        impl = self.inner.build(op, spec)
        if id(impl) not in self._wrapped:
            if op in WRAPPERS:
                self._wrapped[id(impl)] = WRAPPERS[op](impl, spec)
            else:
                raise NotImplementedError(f"op {op!r} has no training form (the trainer runs as one rank)")
        return self._wrapped[id(impl)]
