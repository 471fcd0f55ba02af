"""Qwen3.5 text model (dense and MoE) and its MTP head, per docs/qwen3_5.md.

Layers own their weights (fused at load: q|gate interleave kept inside ``qkv_proj``; GDN
``in_proj = qkv|z|b|a``; ``gate_up`` for MLPs); all compute goes through op impls chosen by the
selector, so the same module runs on every backend.
"""

from __future__ import annotations

import attrs
import torch
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
from bi_core.ops.gdn import GdnWeights
from bi_core.selector import OpFactory


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


@attrs.define
class ModelCaches:
    """Cache tensors a forward reads and writes; owned by the runtime, indexed by layer kind."""

    k: list[torch.Tensor]  # per attention layer: [num_blocks, block_size, Hkv, D]
    v: list[torch.Tensor]
    conv: list[torch.Tensor]  # per GDN layer: [num_slots, conv_dim, Kc - 1]
    recurrent: list[torch.Tensor]  # per GDN layer: [num_slots, Hv, Dv, Dk] float32 (S transposed)


class Linear(nn.Module):
    def __init__(self, factory: OpFactory, in_features: int, out_features: int, dtype, device,
                 silu_mul: bool = False) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype, device=device)
        spec = LinearSpec(**factory.base, in_features=in_features, out_features=out_features, silu_mul=silu_mul)
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
    """Gated full attention: q_proj rows are per-head [query | gate] (kept inside ``qkv_proj``);
    q/k norm, RoPE, the cache write, attention and the sigmoid gate are one attention op."""

    def __init__(self, args: ModelArgs, factory: OpFactory, cache_index: int, dtype, device) -> None:
        super().__init__()
        hq, hkv, d = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.cache_index = cache_index
        self.qkv_proj = Linear(factory, args.hidden_size, 2 * hq * d + 2 * hkv * d, dtype, device)
        self.o_proj = Linear(factory, hq * d, args.hidden_size, dtype, device)
        self.q_norm = _param(d, dtype=dtype, device=device)
        self.k_norm = _param(d, dtype=dtype, device=device)
        spec = AttentionSpec(**factory.base, num_heads=hq, num_kv_heads=hkv, head_dim=d, scale=d**-0.5,
                             rotary_dim=args.rotary_dim, rope_theta=args.rope_theta, norm_eps=args.rms_norm_eps)
        self.attn = factory.build("attention", spec)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, caches: ModelCaches) -> torch.Tensor:
        i = self.cache_index
        o = self.attn.forward(self.qkv_proj(x), self.q_norm, self.k_norm, caches.k[i], caches.v[i], ctx)
        return self.o_proj(o)


class GatedDeltaNet(nn.Module):
    def __init__(self, args: ModelArgs, factory: OpFactory, cache_index: int, dtype, device) -> None:
        super().__init__()
        self.cache_index = cache_index
        hv = args.linear_num_value_heads
        self.in_proj = Linear(factory, args.hidden_size, args.conv_dim + args.value_dim + 2 * hv, dtype, device)
        self.conv1d = _param(args.conv_dim, args.linear_conv_kernel_dim, dtype=dtype, device=device)
        self.A_log = _param(hv, dtype=torch.float32, device=device)
        self.dt_bias = _param(hv, dtype=torch.float32, device=device)
        self.norm_weight = _param(args.linear_value_head_dim, dtype=dtype, device=device)
        self.out_proj = Linear(factory, args.value_dim, args.hidden_size, dtype, device)
        self.gdn = factory.build("gdn", GdnSpec(
            **factory.base, num_k_heads=args.linear_num_key_heads, num_v_heads=hv,
            head_k_dim=args.linear_key_head_dim, head_v_dim=args.linear_value_head_dim,
            conv_kernel=args.linear_conv_kernel_dim, norm_eps=args.rms_norm_eps))

    def forward(self, x: torch.Tensor, ctx: ForwardContext, caches: ModelCaches) -> torch.Tensor:
        i = self.cache_index
        weights = GdnWeights(self.conv1d, self.A_log, self.dt_bias, self.norm_weight)
        return self.out_proj(self.gdn.forward(self.in_proj(x), weights, caches.conv[i], caches.recurrent[i], ctx))


class MLP(nn.Module):
    def __init__(self, factory: OpFactory, hidden: int, intermediate: int, dtype, device) -> None:
        super().__init__()
        self.gate_up_proj = Linear(factory, hidden, 2 * intermediate, dtype, device, silu_mul=True)
        self.down_proj = Linear(factory, intermediate, hidden, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))


class SparseMoE(nn.Module):
    """Softmax top-k router (renormalised), routed SwiGLU experts and a sigmoid-gated shared
    expert. The shared expert is stored as expert E of ``w13``/``w2`` and its gate as row E of the
    router (so one GEMM gives both logits, and the grouped GEMMs run it with the routed experts);
    experts of different widths are zero-padded to the widest: zero gate/up rows give zero
    activations and zero down columns add nothing, so a padded expert computes exactly the same."""

    def __init__(self, args: ModelArgs, factory: OpFactory, dtype, device) -> None:
        super().__init__()
        e, h = args.num_experts, args.hidden_size
        self.num_experts = e
        self.shared = args.shared_expert_intermediate_size > 0
        self.widths = (args.moe_intermediate_size, args.shared_expert_intermediate_size)  # routed, shared
        i = max(self.widths)
        experts = e + (1 if self.shared else 0)
        self.gate = Linear(factory, h, experts, dtype, device)
        self.w13 = _param(experts, 2 * i, h, dtype=dtype, device=device)
        self.w2 = _param(experts, h, i, dtype=dtype, device=device)
        self.topk = factory.build("topk", TopKSpec(**factory.base, num_experts=e, top_k=args.num_experts_per_tok))
        self.experts = factory.build("moe", MoESpec(**factory.base, num_experts=e, top_k=args.num_experts_per_tok,
                                                    hidden_size=h, intermediate_size=i, shared_expert=self.shared))

    @torch.no_grad()
    def zero_padding(self) -> None:
        """Zero the padded rows/columns of narrower experts (after random initialisation)."""
        e, width = self.num_experts, self.w2.shape[2]
        for sl, size in ((slice(0, e), self.widths[0]), (slice(e, e + 1), self.widths[1])):
            self.w13[sl, size:width].zero_()
            self.w13[sl, width + size:].zero_()
            self.w2[sl, :, size:].zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        weights, ids = self.topk.forward(logits[:, : self.num_experts])
        shared = logits[:, self.num_experts] if self.shared else None
        return self.experts.forward(x, weights, ids, self.w13, self.w2, shared)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, factory: OpFactory, layer_type: str, cache_index: int, dtype, device) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = RMSNorm(factory, args.hidden_size, args.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(factory, args.hidden_size, args.rms_norm_eps, dtype, device)
        if layer_type == "full_attention":
            self.mixer = Attention(args, factory, cache_index, dtype, device)
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

    def __init__(self, args: ModelArgs, factory: OpFactory, dtype, device) -> None:
        super().__init__()
        h, eps = args.hidden_size, args.rms_norm_eps
        self.pre_fc_norm_embedding = RMSNorm(factory, h, eps, dtype, device)
        self.pre_fc_norm_hidden = RMSNorm(factory, h, eps, dtype, device)
        self.fc = Linear(factory, 2 * h, h, dtype, device)
        self.layer = DecoderLayer(args, factory, "full_attention", 0, dtype, device)
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
        self.embed_tokens = _param(args.vocab_size, args.hidden_size, dtype=dtype, device=device)
        attn_index = {layer: n for n, layer in enumerate(args.full_attention_layers)}
        gdn_index = {layer: n for n, layer in enumerate(args.gdn_layers)}
        self.layers = nn.ModuleList(
            DecoderLayer(args, factory, t, attn_index.get(i, gdn_index.get(i)), dtype, device)
            for i, t in enumerate(args.layer_types)
        )
        self.norm = RMSNorm(factory, args.hidden_size, args.rms_norm_eps, dtype, device)
        self.lm_head = None if args.tie_word_embeddings else Linear(factory, args.hidden_size, args.vocab_size, dtype, device)
        self._tied_head = None if self.lm_head is not None else factory.build(
            "linear", LinearSpec(**factory.base, in_features=args.hidden_size, out_features=args.vocab_size))
        self.sampler = factory.build("sampling", SamplingSpec(**factory.base, vocab_size=args.vocab_size))
        self.mtp = MtpHead(args, factory, dtype, device) if with_mtp and args.mtp_num_hidden_layers else None
        impls = {id(m.attn): m.attn for m in self.modules() if isinstance(m, Attention)}
        self._step_planners = [i for i in impls.values() if hasattr(i, "prepare")]

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext, caches: ModelCaches
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat batch of token ids ``[T]`` -> (hidden states after the final norm ``[T, H]``, logits of
        the rows ``ctx.logits_indices``)."""
        x, residual = self.embed_tokens[input_ids], None
        for layer in self.layers:
            x, residual = layer(x, residual, ctx, caches)
        hidden = self.norm(x, residual)[0]
        return hidden, self.compute_logits(_logits_rows(hidden, ctx))

    def prepare_step(self, ctx: ForwardContext) -> None:
        """Host-side per-step planning of impls that need it (e.g. FlashInfer), outside any graph."""
        for impl in self._step_planners:
            impl.prepare(ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head(hidden)
        return self._tied_head.forward(hidden, self.embed_tokens)

    def mtp_forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext,
                    caches: ModelCaches) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP head on rows (next token, main hidden of the previous position): (its output
        ``[T, H]``, the greedy draft token of each ``ctx.logits_indices`` row)."""
        m = self.mtp(self.embed_tokens[input_ids], hidden, ctx, caches)
        return m, torch.argmax(self.compute_logits(_logits_rows(m, ctx)), dim=-1)


def _logits_rows(hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
    return hidden if ctx.logits_all_rows else hidden[ctx.logits_indices]
