"""Gated DeltaNet in plain PyTorch: the chunked form (port of transformers'
``torch_chunk_gated_delta_rule``) and the recurrent form, both in fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bi_core.backends.reference.dtypes import check_dtype
from bi_core.backends.reference.norm import gated_rms_norm
from bi_core.ops.context import ForwardContext
from bi_core.ops.gdn import GdnBuilder, GdnSpec, GdnWeights

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def recurrent_delta_rule(q, k, v, g, beta, state, on_token=None, stored_dtype=torch.float32):
    """Per token: ``S = e^g S; u = v - Sᵀk; S += k ⊗ βu; o = Sᵀq``. q,k ``[H, T, Dk]``, v ``[H, T, Dv]``,
    g, beta ``[H, T]``, state ``[H, Dk, Dv]``; all fp32. Returns (o ``[H, T, Dv]``, final state);
    ``on_token(t, state)`` sees the state after each token. A state stored in ``stored_dtype``
    narrower than fp32 is rounded to it after every token, so T tokens in one call compute what T
    one-token steps do."""
    out = torch.empty_like(v)
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[:, None, None]
        kv_mem = (state * k[:, t, :, None]).sum(dim=-2)
        delta = (v[:, t] - kv_mem) * beta[:, t, None]
        state = state + k[:, t, :, None] * delta[:, None, :]
        out[:, t] = (state * q[:, t, :, None]).sum(dim=-2)
        if on_token is not None:
            on_token(t, state)
        if stored_dtype != torch.float32:
            state = state.to(stored_dtype).float()
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


def split_proj(proj: torch.Tensor, spec: GdnSpec):
    """in_proj output -> (pre-conv qkv ``[T, conv_dim]``, z ``[T, Hv*Dv]``, b ``[T, Hv]``, a ``[T, Hv]``)."""
    hv = spec.num_v_heads
    return torch.split(proj, [spec.conv_dim, spec.value_dim, hv, hv], dim=-1)


def gates(a: torch.Tensor, b: torch.Tensor, w: GdnWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta): ``g = -exp(A_log) * softplus(a + dt_bias)`` in fp32, ``beta = sigmoid(b)`` in the
    model dtype (as transformers computes them)."""
    return -w.A_log.exp() * F.softplus(a.float() + w.dt_bias), torch.sigmoid(b)


class ReferenceGdnImpl:
    def __init__(self, spec: GdnSpec) -> None:
        self.spec = spec
        self.group = spec.num_v_heads // spec.num_k_heads

    def forward(self, proj, weights: GdnWeights, conv_state, state, ctx: ForwardContext,
                seqs: list[int] | None = None) -> torch.Tensor:
        """``seqs``: compute only these sequences (their rows of the result; default all)."""
        s = self.spec
        t = proj.shape[0]
        seqs = range(ctx.num_seqs) if seqs is None else seqs
        mixed, z, b, a = split_proj(proj, s)
        mixed = self.conv(mixed.contiguous(), weights.conv1d, conv_state, ctx, seqs)
        q, k, v = torch.split(mixed, [s.key_dim, s.key_dim, s.value_dim], dim=-1)
        o = self.delta_rule(q.reshape(t, s.num_k_heads, s.head_k_dim), k.reshape(t, s.num_k_heads, s.head_k_dim),
                            v.reshape(t, s.num_v_heads, s.head_v_dim), a, b, weights, state, ctx, seqs)
        dv = s.head_v_dim
        return gated_rms_norm(o.reshape(-1, dv), z.reshape(-1, dv), weights.norm, s.norm_eps).reshape(t, s.value_dim)

    def conv(self, x, weight, conv_state, ctx: ForwardContext, seqs=None) -> torch.Tensor:
        width = weight.shape[1] - 1
        out = torch.zeros_like(x)
        w = weight.float()
        for i in range(ctx.num_seqs) if seqs is None else seqs:
            start, end = ctx.real_range(i)  # padding rows (a graph's) stay zero
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

    def delta_rule(self, q, k, v, a, b, weights: GdnWeights, state, ctx: ForwardContext, seqs=None) -> torch.Tensor:
        """The delta rule over each sequence's rows, its gates (``gates`` of ``a``, ``b``) computed
        from its own rows: torch's CPU kernels compute a vector's tail with other code than its
        body (softplus: std::log1p/exp against SLEEF), so gates over the whole step gave a row
        bits that followed the step's row count (seen on an AVX-512 CPU)."""
        out = torch.zeros_like(v)
        scale = self.spec.head_k_dim**-0.5
        for i in range(ctx.num_seqs) if seqs is None else seqs:
            start, end = ctx.real_range(i)  # padding rows (a graph's) stay zero
            slot = ctx.state_slots_host[i]
            qi = l2norm(q[start:end].float().repeat_interleave(self.group, dim=1)).transpose(0, 1) * scale
            ki = l2norm(k[start:end].float().repeat_interleave(self.group, dim=1)).transpose(0, 1)
            vi = v[start:end].float().transpose(0, 1)
            gi, bi = (x.float().transpose(0, 1) for x in gates(a[start:end], b[start:end], weights))
            # the cache holds S transposed ([Hv, Dv, Dk]); the math here uses S [Hv, Dk, Dv]
            # contiguous: CPU reductions follow the memory layout, and a step must see the same
            # layout whether its state came from the cache or from the previous token
            s0 = state[slot].transpose(-1, -2).contiguous()
            s0 = s0 if ctx.past_len(i) > 0 else torch.zeros_like(s0)
            slots = ctx.token_state_slots_host[start:end]
            if ctx.is_recurrent_host[i]:
                def keep(t, s, slots=slots):
                    if ctx.state_ring > 1 or t == len(slots) - 1:
                        state[slots[t]] = s.transpose(-1, -2)
                o, _ = recurrent_delta_rule(qi, ki, vi, gi, bi, s0.float(), on_token=keep, stored_dtype=state.dtype)
            else:
                o, s1 = chunk_delta_rule(qi, ki, vi, gi, bi, s0.float())
                state[slots[-1]] = s1.transpose(-1, -2)
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
