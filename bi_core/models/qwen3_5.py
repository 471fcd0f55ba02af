"""Qwen3.5 text model (dense and MoE) and its MTP head, per docs/qwen3_5.md.

Layers own their weights (fused at load: q|gate interleave kept inside ``qkv_proj``; GDN
``in_proj = qkv|z|b|a``; ``gate_up`` for MLPs); all compute goes through op impls chosen by the
selector, so the same module runs on every backend.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from bi_core.models.args import ModelArgs
from bi_core.ops import (
    AttentionSpec,
    ForwardContext,
    GdnSpec,
    LinearSpec,
    MoESpec,
    NormSpec,
    SamplingSpec,
    TopKSpec,
)
from bi_core.selector import OpFactory


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


@attrs.define
class ModelCaches:
    """Cache tensors a forward reads and writes; owned by the runtime, indexed by layer kind."""

    k: list[torch.Tensor]  # per attention layer: [num_blocks, block_size, Hkv, D]
    v: list[torch.Tensor]
    conv: list[torch.Tensor]  # per GDN layer: [num_slots, conv_dim, Kc - 1]
    recurrent: list[torch.Tensor]  # per GDN layer: [num_slots, Hv, Dk, Dv] float32


class Rope:
    """Partial NeoX RoPE on the first ``rotary_dim`` dims; tables in fp32, applied in the model dtype
    (text-only M-RoPE equals 1-D RoPE)."""

    def __init__(self, args: ModelArgs, device: torch.device) -> None:
        dim = args.rotary_dim
        self.dim = dim
        self.inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.dim], x[..., self.dim :]
        half = self.dim // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


class Linear(nn.Module):
    def __init__(self, factory: OpFactory, in_features: int, out_features: int, dtype, device) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype, device=device)
        spec = LinearSpec(**factory.base, in_features=in_features, out_features=out_features)
        self.impl = factory.build("linear", spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.impl.forward(x, self.weight)


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm, ``forward(x)`` or ``forward(x, residual)`` (fused add)."""

    def __init__(self, factory: OpFactory, size: int, eps: float, dtype, device) -> None:
        super().__init__()
        self.weight = _param(size, dtype=dtype, device=device)
        self.impl = factory.build("norm", NormSpec(**factory.base, hidden_size=size, eps=eps))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.impl.forward(x, self.weight)
        return self.impl.forward_add(x, residual, self.weight)


class Attention(nn.Module):
    """Gated full attention: q_proj rows are per-head [query | gate]; sigmoid gate before o_proj."""

    def __init__(self, args: ModelArgs, factory: OpFactory, cache_index: int, rope: Rope, dtype, device) -> None:
        super().__init__()
        hq, hkv, d = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = hq, hkv, d
        self.cache_index, self.rope = cache_index, rope
        self.qkv_proj = Linear(factory, args.hidden_size, 2 * hq * d + 2 * hkv * d, dtype, device)
        self.o_proj = Linear(factory, hq * d, args.hidden_size, dtype, device)
        self.q_norm = RMSNorm(factory, d, args.rms_norm_eps, dtype, device)
        self.k_norm = RMSNorm(factory, d, args.rms_norm_eps, dtype, device)
        spec = AttentionSpec(**factory.base, num_heads=hq, num_kv_heads=hkv, head_dim=d,
                             scale=d**-0.5)
        self.attn = factory.build("attention", spec)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, caches: ModelCaches) -> torch.Tensor:
        t, hq, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        qg = qkv[:, : 2 * hq * d].view(t, hq, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(t, hq * d)
        k = qkv[:, 2 * hq * d : 2 * hq * d + hkv * d].view(t, hkv, d)
        v = qkv[:, 2 * hq * d + hkv * d :].view(t, hkv, d)
        q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        cos, sin = self.rope.cos_sin(ctx.positions, x.dtype)
        q, k = self.rope.apply(q, cos, sin), self.rope.apply(k, cos, sin)
        i = self.cache_index
        o = self.attn.forward(q, k, v.contiguous(), caches.k[i], caches.v[i], ctx)
        return self.o_proj(o.reshape(t, hq * d) * torch.sigmoid(gate))


class GatedDeltaNet(nn.Module):
    def __init__(self, args: ModelArgs, factory: OpFactory, cache_index: int, dtype, device) -> None:
        super().__init__()
        self.args, self.cache_index = args, cache_index
        hv = args.linear_num_value_heads
        self.in_proj = Linear(factory, args.hidden_size, args.conv_dim + args.value_dim + 2 * hv, dtype, device)
        self.conv1d = _param(args.conv_dim, args.linear_conv_kernel_dim, dtype=dtype, device=device)
        self.A_log = _param(hv, dtype=torch.float32, device=device)
        self.dt_bias = _param(hv, dtype=torch.float32, device=device)
        self.norm_weight = _param(args.linear_value_head_dim, dtype=dtype, device=device)
        self.out_proj = Linear(factory, args.value_dim, args.hidden_size, dtype, device)
        self.norm = factory.build("norm", NormSpec(**factory.base, hidden_size=args.linear_value_head_dim,
                                                   eps=args.rms_norm_eps, kind="rms_gated"))
        self.gdn = factory.build("gdn", GdnSpec(
            **factory.base, num_k_heads=args.linear_num_key_heads, num_v_heads=hv,
            head_k_dim=args.linear_key_head_dim, head_v_dim=args.linear_value_head_dim,
            conv_kernel=args.linear_conv_kernel_dim))

    def forward(self, x: torch.Tensor, ctx: ForwardContext, caches: ModelCaches) -> torch.Tensor:
        a_ = self.args
        t, hv = x.shape[0], a_.linear_num_value_heads
        proj = self.in_proj(x)
        mixed, z, b, a = torch.split(proj, [a_.conv_dim, a_.value_dim, hv, hv], dim=-1)
        i = self.cache_index
        mixed = self.gdn.conv(mixed.contiguous(), self.conv1d, caches.conv[i], ctx)
        q, k, v = torch.split(mixed, [a_.key_dim, a_.key_dim, a_.value_dim], dim=-1)
        q = q.reshape(t, a_.linear_num_key_heads, a_.linear_key_head_dim)
        k = k.reshape(t, a_.linear_num_key_heads, a_.linear_key_head_dim)
        v = v.reshape(t, hv, a_.linear_value_head_dim)
        beta = torch.sigmoid(b)
        g = -self.A_log.exp() * F.softplus(a.float() + self.dt_bias)
        o = self.gdn.delta_rule(q, k, v, g, beta, caches.recurrent[i], ctx)
        dv = a_.linear_value_head_dim
        o = self.norm.forward(o.reshape(-1, dv), z.reshape(-1, dv), self.norm_weight)
        return self.out_proj(o.reshape(t, a_.value_dim))


class MLP(nn.Module):
    def __init__(self, factory: OpFactory, hidden: int, intermediate: int, dtype, device) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(factory, hidden, 2 * intermediate, dtype, device)
        self.down_proj = Linear(factory, intermediate, hidden, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoE(nn.Module):
    """Softmax top-k router (renormalised), routed SwiGLU experts, sigmoid-gated shared expert."""

    def __init__(self, args: ModelArgs, factory: OpFactory, dtype, device) -> None:
        super().__init__()
        e, h, i = args.num_experts, args.hidden_size, args.moe_intermediate_size
        self.gate = Linear(factory, h, e, dtype, device)
        self.w13 = _param(e, 2 * i, h, dtype=dtype, device=device)
        self.w2 = _param(e, h, i, dtype=dtype, device=device)
        self.shared_expert = MLP(factory, h, args.shared_expert_intermediate_size, dtype, device)
        self.shared_expert_gate = Linear(factory, h, 1, dtype, device)
        self.topk = factory.build("topk", TopKSpec(**factory.base, num_experts=e,
                                                   top_k=args.num_experts_per_tok))
        self.experts = factory.build("moe", MoESpec(**factory.base, num_experts=e,
                                                    top_k=args.num_experts_per_tok, hidden_size=h,
                                                    intermediate_size=i))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.topk.forward(self.gate(x))
        routed = self.experts.forward(x, weights, ids, self.w13, self.w2)
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, factory: OpFactory, layer_type: str, cache_index: int, rope: Rope,
                 dtype, device) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = RMSNorm(factory, args.hidden_size, args.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(factory, args.hidden_size, args.rms_norm_eps, dtype, device)
        if layer_type == "full_attention":
            self.mixer = Attention(args, factory, cache_index, rope, dtype, device)
        else:
            self.mixer = GatedDeltaNet(args, factory, cache_index, dtype, device)
        if args.is_moe:
            self.mlp = SparseMoE(args, factory, dtype, device)
        else:
            self.mlp = MLP(factory, args.hidden_size, args.intermediate_size, dtype, device)

    def forward(self, x, residual, ctx, caches):
        h, residual = (self.input_layernorm(x), x) if residual is None else self.input_layernorm(x, residual)
        h = self.mixer(h, ctx, caches)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class MtpHead(nn.Module):
    """``fc([norm(emb(next token)), norm(hidden)])`` -> one gated-attention decoder layer (own KV
    cache) -> ``mtp.norm``; logits through the main model's lm_head."""

    def __init__(self, args: ModelArgs, factory: OpFactory, rope: Rope, dtype, device) -> None:
        super().__init__()
        h, eps = args.hidden_size, args.rms_norm_eps
        self.pre_fc_norm_embedding = RMSNorm(factory, h, eps, dtype, device)
        self.pre_fc_norm_hidden = RMSNorm(factory, h, eps, dtype, device)
        self.fc = Linear(factory, 2 * h, h, dtype, device)
        self.layer = DecoderLayer(args, factory, "full_attention", 0, rope, dtype, device)
        self.norm = RMSNorm(factory, h, eps, dtype, device)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext, caches: ModelCaches):
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        h, residual = self.layer(x, None, ctx, caches)
        return self.norm(h, residual)[0]


class Qwen35Model(nn.Module):
    def __init__(self, args: ModelArgs, factory: OpFactory, dtype: torch.dtype, device: torch.device,
                 with_mtp: bool = True) -> None:
        super().__init__()
        self.args, self.dtype, self.device = args, dtype, device
        self.rope = Rope(args, factory.base["device"])
        self.embed_tokens = _param(args.vocab_size, args.hidden_size, dtype=dtype, device=device)
        attn_index = {layer: n for n, layer in enumerate(args.full_attention_layers)}
        gdn_index = {layer: n for n, layer in enumerate(args.gdn_layers)}
        self.layers = nn.ModuleList(
            DecoderLayer(args, factory, t, attn_index.get(i, gdn_index.get(i)), self.rope, dtype, device)
            for i, t in enumerate(args.layer_types)
        )
        self.norm = RMSNorm(factory, args.hidden_size, args.rms_norm_eps, dtype, device)
        self.lm_head = None if args.tie_word_embeddings else Linear(factory, args.hidden_size, args.vocab_size, dtype, device)
        self._tied_head = None if self.lm_head is not None else factory.build(
            "linear", LinearSpec(**factory.base, in_features=args.hidden_size, out_features=args.vocab_size))
        self.sampler = factory.build("sampling", SamplingSpec(**factory.base, vocab_size=args.vocab_size))
        self.mtp = MtpHead(args, factory, self.rope, dtype, device) if with_mtp and args.mtp_num_hidden_layers else None
        impls = {id(m.attn): m.attn for m in self.modules() if isinstance(m, Attention)}
        self._step_planners = [i for i in impls.values() if hasattr(i, "prepare")]

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext, caches: ModelCaches) -> torch.Tensor:
        """Flat batch of token ids ``[T]`` -> hidden states after the final norm ``[T, H]``."""
        x, residual = self.embed_tokens[input_ids], None
        for layer in self.layers:
            x, residual = layer(x, residual, ctx, caches)
        return self.norm(x, residual)[0]

    def prepare_step(self, ctx: ForwardContext) -> None:
        """Host-side per-step planning of impls that need it (e.g. FlashInfer), outside any graph."""
        for impl in self._step_planners:
            impl.prepare(ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head(hidden)
        return self._tied_head.forward(hidden, self.embed_tokens)

    def mtp_forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext,
                    caches: ModelCaches) -> torch.Tensor:
        """The MTP head on rows (next token, main hidden of the previous position)."""
        return self.mtp(self.embed_tokens[input_ids], hidden, ctx, caches)
