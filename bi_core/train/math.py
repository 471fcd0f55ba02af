"""The ops' mathematics in differentiable PyTorch, over whole sequences: what the backward of a
training forward differentiates. The forward runs the engine's kernels (``train/ops.py``); these
recompute the same functions from the saved inputs under autograd, so gradients are correct (they
are not the forward's bits, and need not be). GDN's delta rule is the reference backend's chunked
form: fla 0.6's chunked backward refuses to run on Hopper under Triton < 3.7.1 (wrong results
there, fla #640), the Triton the engine ships with."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bi_core.backends.reference.attention import Rope, split_qkv
from bi_core.backends.reference.gdn import chunk_delta_rule, gates, l2norm, split_proj
from bi_core.backends.reference.norm import gated_rms_norm, rms_norm_1p
from bi_core.ops.attention import AttentionSpec
from bi_core.ops.gdn import GdnSpec, GdnWeights


def silu_mul_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, weight).chunk(2, dim=-1)
    return F.silu(gate) * up


def lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
         silu_mul: bool) -> torch.Tensor:
    """``y + (x @ a[s].T) @ b[s].T`` per row of slot ``s`` (``-1``: none), then SwiGLU's
    ``silu(gate) * up`` for a fused ``[gate; up]`` projection (``ops/lora.py``)."""
    out = y
    for s in slots.unique().tolist():
        if s >= 0:
            rows = (slots == s).nonzero()[:, 0]
            out = out.index_add(0, rows, (x[rows] @ a[s].t()) @ b[s].t())
    if not silu_mul:
        return out
    gate, up = out.chunk(2, dim=-1)
    return F.silu(gate) * up


_GROUPED_MM = getattr(F, "grouped_mm", None)  # torch >= 2.10


def moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
        shared_logits: torch.Tensor | None = None) -> torch.Tensor:
    """The experts' weighted sum (the shared expert, stacked last, gated by ``shared_logits``), as
    the reference MoE computes it, in a form whose backward stays cheap: (token, slot) pairs, the
    shared expert's included, sorted by expert into one contiguous block of rows per expert, the
    blocks through ``grouped_mm`` (bf16, as transformers' MoE trains) or one expert at a time from
    ``unbind`` views. (Indexing ``w13[e]`` under autograd would zero-fill a whole stack's gradient
    per expert; writing each expert's outputs into a ``[T, top_k, H]`` buffer in place would clone
    it per expert.)"""
    return _moe(x, topk_weights, topk_ids, w13, w2, shared_logits)


def moe_lora(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
             w2: torch.Tensor, shared_logits: torch.Tensor | None, routed: tuple[torch.Tensor, ...],
             pairs: torch.Tensor, shared: tuple[torch.Tensor, ...] | None = None,
             slots: torch.Tensor | None = None) -> torch.Tensor:
    """``moe`` with expert adapters (``ops/moe.py`` ``ExpertLora``), as the reference's ``with_lora``:
    per (token, slot) pair its expert's gate|up output plus its delta (stack row ``pairs[p]`` of
    ``routed``'s a13/b13), SiLU-and-mul, the down output plus its delta (a2/b2); the shared
    expert's pair (each token's last) takes ``shared``'s stacks at row ``slots[t]``; then the combine."""
    return _moe(x, topk_weights, topk_ids, w13, w2, shared_logits, (routed, pairs, shared, slots))


def _moe(x, topk_weights, topk_ids, w13, w2, shared_logits, lora=None) -> torch.Tensor:
    num_tokens, top_k = topk_ids.shape
    ids = topk_ids if shared_logits is None else torch.cat(
        [topk_ids, torch.full((num_tokens, 1), w13.shape[0] - 1, dtype=topk_ids.dtype, device=x.device)], 1)
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    grouped = _GROUPED_MM is not None and x.dtype == torch.bfloat16
    g = _gemm_blocks(x[order // k], counts, w13, grouped)[inverse]  # [T * k, 2I], pairs in (token, slot) order
    if lora is not None:
        g = _deltas(g, x.repeat_interleave(k, dim=0), lora, 0, k)
    gate, up = g.chunk(2, dim=-1)
    h = F.silu(gate) * up
    y = _gemm_blocks(h[order], counts, w2, grouped)[inverse]
    if lora is not None:
        y = _deltas(y, h, lora, 2, k)
    y = y.view(num_tokens, k, -1)
    out = (y[:, :top_k] * topk_weights.to(x.dtype)[..., None]).float().sum(dim=1).to(x.dtype)
    if shared_logits is None:
        return out
    return out + torch.sigmoid(shared_logits[:, None]) * y[:, top_k]


def _gemm_blocks(rows: torch.Tensor, counts: torch.Tensor, w: torch.Tensor, grouped: bool) -> torch.Tensor:
    """Rows sorted by expert (``counts[e]`` of expert ``e``) times their expert's ``w[e].T``."""
    if grouped:
        return _GROUPED_MM(rows, w.transpose(1, 2), offs=torch.cumsum(counts, 0, dtype=torch.int32))
    ws, blocks, start = w.unbind(0), [], 0
    for e, count in enumerate(counts.tolist()):
        if count:
            blocks.append(F.linear(rows[start:start + count], ws[e]))
            start += count
    return torch.cat(blocks)


def _deltas(y: torch.Tensor, inputs: torch.Tensor, lora, first: int, k: int) -> torch.Tensor:
    """``y`` (one row a pair) plus the adapters' deltas of the pairs' ``inputs``: the routed stacks
    ``first``, ``first + 1`` (a13/b13 or a2/b2) at row ``pairs[p]``, the shared expert's (its pair,
    each token's last) at row ``slots[t]``."""
    routed, pairs, shared, slots = lora
    y = _add_rows(y, inputs, routed[first], routed[first + 1], pairs)
    if shared is None:
        return y
    y3, x3 = y.view(-1, k, y.shape[-1]), inputs.view(-1, k, inputs.shape[-1])
    last = _add_rows(y3[:, -1], x3[:, -1], shared[first], shared[first + 1], slots)
    return torch.cat([y3[:, :-1], last[:, None]], dim=1).reshape(y.shape)


def _add_rows(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``y + (x a[i].T) b[i].T`` on the rows of stack row ``i = index[row]`` (-1: none); the stacks
    read through ``unbind`` (indexing them per row would zero-fill a stack's gradient each time)."""
    a_s, b_s = a.unbind(0), b.unbind(0)
    rows, deltas = [], []
    for s in index.unique().tolist():
        if s >= 0:
            r = (index == s).nonzero()[:, 0]
            rows.append(r)
            deltas.append(F.linear(F.linear(x[r], a_s[s]), b_s[s]))
    return y.index_add(0, torch.cat(rows), torch.cat(deltas)) if rows else y


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_1p(x, weight, eps)


def norm_add(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    r = x + residual
    return rms_norm_1p(r, weight, eps), r


def topk_weights(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The router's renormalised weights of the experts ``ids`` it chose."""
    picked = torch.softmax(logits.float(), dim=-1).gather(1, ids)
    return picked / picked.sum(dim=-1, keepdim=True)


def attention(spec: AttentionSpec, rope: Rope, qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
              spans: list[tuple[int, int]], positions: torch.Tensor) -> torch.Tensor:
    """Gated attention of every sequence over its own rows (causal, GQA), ``[T, Hq*D]``."""
    q, gate, k, v = split_qkv(qkv, spec)
    q, k = rms_norm_1p(q, q_norm, spec.norm_eps), rms_norm_1p(k, k_norm, spec.norm_eps)
    cos, sin = rope.cos_sin(positions, qkv.dtype)
    q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
    out = []
    for a, b in spans:
        o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None],
                                           v[a:b].transpose(0, 1)[None], is_causal=True, scale=spec.scale,
                                           enable_gqa=True)
        out.append(o[0].transpose(0, 1).reshape(b - a, -1))
    return torch.cat(out) * torch.sigmoid(gate)


def _conv(mixed: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv1d + SiLU of one sequence's rows ``[T, C]`` (weight ``[C, K]``)."""
    width = weight.shape[1]
    x = F.pad(mixed.t()[None], (width - 1, 0))
    return F.silu(F.conv1d(x, weight[:, None, :], groups=weight.shape[0])[0].t())


def gdn(spec: GdnSpec, proj: torch.Tensor, weights: GdnWeights, spans: list[tuple[int, int]]) -> torch.Tensor:
    """The GDN mixer core of every sequence over its own rows from zero states, ``[T, value_dim]``."""
    s = spec
    mixed, z, b, a = split_proj(proj, s)
    group = s.num_v_heads // s.num_k_heads
    g, beta = gates(a, b, weights)
    convolved = torch.cat([_conv(mixed[lo:hi], weights.conv1d) for lo, hi in spans])
    q, k, v = torch.split(convolved, [s.key_dim, s.key_dim, s.value_dim], dim=-1)
    q = q.reshape(-1, s.num_k_heads, s.head_k_dim).repeat_interleave(group, dim=1)
    k = k.reshape(-1, s.num_k_heads, s.head_k_dim).repeat_interleave(group, dim=1)
    v = v.reshape(-1, s.num_v_heads, s.head_v_dim)
    out = _delta_rule(q, k, v, g, beta.float(), s, spans)
    o = out.to(proj.dtype).reshape(-1, s.num_v_heads, s.head_v_dim)
    y = gated_rms_norm(o, z.reshape(o.shape), weights.norm, s.norm_eps)
    return y.reshape(-1, s.value_dim)


def _delta_rule(q, k, v, g, beta, spec: GdnSpec, spans) -> torch.Tensor:
    """``o [T, Hv, Dv]`` (fp32) of the gated delta rule, q and k L2-normalised here. The sequences
    run as one call: each padded at its end to the longest (``g = beta = 0`` there: the padding
    comes after a sequence's rows and changes none of them) and stacked along the heads, so the
    scan over chunks runs once for the batch, not once per sequence."""
    q, k = l2norm(q.float()) * spec.head_k_dim**-0.5, l2norm(k.float())
    v = v.float()
    longest = max(hi - lo for lo, hi in spans)

    def stacked(x):  # [T, H, ...] -> [n * H, longest, ...]
        parts = [F.pad(x[lo:hi].transpose(0, 1), (0, 0) * (x.dim() - 2) + (0, longest - hi + lo)) for lo, hi in spans]
        return torch.cat(parts)

    heads = spec.num_v_heads
    state = torch.zeros(len(spans) * heads, spec.head_k_dim, spec.head_v_dim, dtype=torch.float32, device=q.device)
    o, _ = chunk_delta_rule(stacked(q), stacked(k), stacked(v), stacked(g), stacked(beta), state)
    return torch.cat([o[i * heads:(i + 1) * heads, :hi - lo].transpose(0, 1) for i, (lo, hi) in enumerate(spans)])
