"""Gated DeltaNet in plain PyTorch: the chunked form (port of transformers'
``torch_chunk_gated_delta_rule``) and the recurrent form, both in fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bi_core.backends.reference.common import check_dtype
from bi_core.ops.context import ForwardContext
from bi_core.ops.gdn import GdnBuilder, GdnSpec

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def recurrent_delta_rule(q, k, v, g, beta, state, on_token=None):
    """Per token: ``S = e^g S; u = v - Sᵀk; S += k ⊗ βu; o = Sᵀq``. q,k ``[H, T, Dk]``, v ``[H, T, Dv]``,
    g, beta ``[H, T]``, state ``[H, Dk, Dv]``; all fp32. Returns (o ``[H, T, Dv]``, final state);
    ``on_token(t, state)`` sees the state after each token."""
    out = torch.empty_like(v)
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[:, None, None]
        kv_mem = (state * k[:, t, :, None]).sum(dim=-2)
        delta = (v[:, t] - kv_mem) * beta[:, t, None]
        state = state + k[:, t, :, None] * delta[:, None, :]
        out[:, t] = (state * q[:, t, :, None]).sum(dim=-2)
        if on_token is not None:
            on_token(t, state)
    return out, state


def chunk_delta_rule(q, k, v, g, beta, state):
    """The same recurrence in chunks of 64 (UT transform inside a chunk, scan across chunks)."""
    num_heads, length, _ = q.shape
    pad = (CHUNK - length % CHUNK) % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    num_chunks = (length + pad) // CHUNK
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(num_heads, num_chunks, CHUNK, -1) for x in (q, k, k_beta, v_beta))
    cum = g.reshape(num_heads, num_chunks, CHUNK).cumsum(dim=-1)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    new_values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.zeros_like(new_values)
    for i in range(num_chunks):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ state
        out[:, i] = q[:, i] @ state + intra[:, i] @ v_new
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(num_heads, -1, out.shape[-1])[:, :length], state


class ReferenceGdnImpl:
    def __init__(self, spec: GdnSpec) -> None:
        self.spec = spec
        self.group = spec.num_v_heads // spec.num_k_heads

    def conv(self, x, weight, conv_state, ctx: ForwardContext) -> torch.Tensor:
        width = weight.shape[1] - 1
        out = torch.empty_like(x)
        w = weight.float()
        for i in range(ctx.num_seqs):
            start, end = ctx.token_range(i)
            slot = ctx.state_slots_host[i]
            if ctx.past_len(i) > 0:
                history = conv_state[slot].transpose(0, 1).to(x.dtype)
            else:
                history = x.new_zeros(width, x.shape[1])
            full = torch.cat([history, x[start:end]], dim=0)  # [width + n, C]
            n = end - start
            acc = sum(w[:, j] * full[j : j + n].float() for j in range(width + 1))
            out[start:end] = F.silu(acc.to(x.dtype))
            steps = range(n) if ctx.state_ring > 1 else [n - 1]  # the window after each token, or the last
            for t in steps:
                dst = ctx.token_state_slots_host[start + t]
                conv_state[dst] = full[t + 1 : t + 1 + width].transpose(0, 1).to(conv_state.dtype)
        return out

    def delta_rule(self, q, k, v, g, beta, state, ctx: ForwardContext) -> torch.Tensor:
        out = torch.empty_like(v)
        scale = self.spec.head_k_dim**-0.5
        for i in range(ctx.num_seqs):
            start, end = ctx.token_range(i)
            slot = ctx.state_slots_host[i]
            qi = l2norm(q[start:end].float().repeat_interleave(self.group, dim=1)).transpose(0, 1) * scale
            ki = l2norm(k[start:end].float().repeat_interleave(self.group, dim=1)).transpose(0, 1)
            vi = v[start:end].float().transpose(0, 1)
            gi, bi = g[start:end].float().transpose(0, 1), beta[start:end].float().transpose(0, 1)
            s0 = state[slot] if ctx.past_len(i) > 0 else torch.zeros_like(state[slot])
            slots = ctx.token_state_slots_host[start:end]
            if ctx.is_recurrent_host[i]:
                def keep(t, s, slots=slots):
                    if ctx.state_ring > 1 or t == len(slots) - 1:
                        state[slots[t]] = s
                o, _ = recurrent_delta_rule(qi, ki, vi, gi, bi, s0.float(), on_token=keep)
            else:
                o, s1 = chunk_delta_rule(qi, ki, vi, gi, bi, s0.float())
                state[slots[-1]] = s1
            out[start:end] = o.transpose(0, 1).to(v.dtype)
        return out


class ReferenceGdnBuilder(GdnBuilder):
    def check(self, spec: GdnSpec, policy) -> list[str]:
        reasons = check_dtype(spec)
        if spec.num_v_heads % spec.num_k_heads:
            reasons.append(f"num_v_heads {spec.num_v_heads} is not a multiple of num_k_heads {spec.num_k_heads}")
        return reasons

    def build(self, spec: GdnSpec) -> ReferenceGdnImpl:
        return ReferenceGdnImpl(spec)
