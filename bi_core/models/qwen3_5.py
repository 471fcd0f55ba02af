"""Qwen3.5 text model (dense and MoE) and its MTP head, as specified in dev/qwen3_5.md.

Layers own their weights (fused at load: q|gate interleave kept inside ``qkv_proj``; GDN
``in_proj = qkv|z|b|a``; ``gate_up`` for MLPs); all compute goes through op impls chosen by the
selector, so the same module runs on every backend.
"""

from __future__ import annotations

import inspect
import math

import attrs
import torch
from torch import nn

from bi_core.errors import BackendSelectionError, CheckpointError
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
from bi_core.ops.activation import Fp8Activation, dense
from bi_core.ops.collective import CollectiveSpec
from bi_core.ops.context import ModelCaches
from bi_core.ops.gdn import GdnWeights
from bi_core.parallel.shard import Shard, TPInfo, split
from bi_core.quant import params as q
from bi_core.quant.scheme import GDN_HEAD, GDN_TAIL, MOE, MTP_FC, Fp8Weights, fp8_weights, splits_gdn_in_proj
from bi_core.selector import OpFactory

NO_TP = TPInfo()


def _param(*shape: int, dtype: torch.dtype, device: torch.device, tp: TPInfo = NO_TP,
           shard: Shard | None = None) -> nn.Parameter:
    """A parameter of full shape ``shape``; with tensor parallelism, this rank's part of it along
    ``shard`` (the loader and the random initialiser read ``shard`` and ``full_shape``)."""
    p = nn.Parameter(torch.empty(*tp.local_shape(shape, shard), dtype=dtype, device=device), requires_grad=False)
    if shard is not None and tp.world > 1:
        p.shard, p.full_shape, p.tp = shard, tuple(shape), tp
    return p


def _draw_together(head: nn.Parameter, tail: nn.Parameter, shape: tuple[int, int], shard: Shard,
                   tp: TPInfo) -> None:
    """``head`` and ``tail`` are the rows of one weight of ``shape`` (split over ranks by ``shard``)
    that the unquantized model holds as one parameter: a random init draws them together (the
    same numbers in both models)."""
    head.draw_shape, head.drawn_tail, tail.drawn_with_head = shape, tail, True
    if tp.world > 1:
        head.draw_shard = shard


class TensorParallel:
    """This rank's place and its collectives (none with one rank)."""

    def __init__(self, factory: OpFactory, info: TPInfo) -> None:
        self.info = info
        if info.world > 1:
            spec = CollectiveSpec(**factory.base, world_size=info.world)
            self._reduce = factory.build("all_reduce", spec)
            self._gather = factory.build("all_gather", spec)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of the ranks' partial results (after a row-parallel projection)."""
        return x if self.info.world == 1 else self._reduce.forward(x)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' column blocks side by side (vocabulary-parallel logits)."""
        return x if self.info.world == 1 else self._gather.forward(x)


def _spec_format(fp8: Fp8Weights | None) -> dict:
    """The op spec's weight-format fields (none for dense weights: their specs stay as before)."""
    return {} if fp8 is None else {"weight_format": "fp8_block", "block_size": fp8.block}


def _fp8_param(shape: tuple[int, ...], fp8: Fp8Weights, dtype, device, tp: TPInfo, shard: Shard | None
               ) -> tuple[nn.Parameter, nn.Parameter]:
    """An FP8 weight of full ``shape`` and its block scales (this rank's blocks)."""
    scale = q.scale_param(shape, fp8, device, tp, shard)  # checks the block layout first
    weight = _param(*shape, dtype=q.FP8, device=device, tp=tp, shard=shard)
    q.attach(weight, scale, fp8, dtype)
    return weight, scale


class Linear(nn.Module):
    """``x @ W.T``; with ``shard`` (split(0, ...): column-parallel, split(1, ...): row-parallel,
    whose partial results the caller all-reduces) this rank's part of ``W``. With ``fp8``, ``W`` is
    float8_e4m3fn with float32 block scales ``weight_scale_inv`` (``bi_core/quant``)."""

    def __init__(self, factory: OpFactory, in_features: int, out_features: int, dtype, device,
                 silu_mul: bool = False, tp: TPInfo = NO_TP, shard: Shard | None = None,
                 fp8: Fp8Weights | None = None) -> None:
        super().__init__()
        if fp8 is None:
            self.weight = _param(out_features, in_features, dtype=dtype, device=device, tp=tp, shard=shard)
            self.weight_scale_inv = None
        else:
            self.weight, self.weight_scale_inv = _fp8_param((out_features, in_features), fp8, dtype, device, tp, shard)
        out_features, in_features = self.weight.shape
        spec = LinearSpec(**factory.base, in_features=in_features, out_features=out_features, silu_mul=silu_mul,
                          **_spec_format(fp8))
        self.spec, self.impl = spec, factory.build("linear", spec)
        self.lora = None  # a LoraTarget when the engine serves adapters (bi_core/lora/targets.py)

    def forward(self, x: torch.Tensor | Fp8Activation, out: torch.Tensor | None = None,
                lora_slots: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T``; with ``out`` (columns of a wider buffer) written there (LinearImpl's
        ``writes_into``; the result copied for an impl that does not). With adapters (``lora``),
        each row's delta is added after the base GEMM (FP8 too), ``lora_slots [T]`` saying whose."""
        y = self._base(x, out)
        if self.lora is None:
            return y
        if lora_slots is None:  # rows without adapters (the lora op still applies a fused SiLU-and-mul)
            lora_slots = torch.full((y.shape[0],), -1, dtype=torch.int64, device=y.device)
        t = self.lora
        return t.impl.forward(y, dense(x), t.a, t.b, lora_slots, t.ranks)

    def _base(self, x: torch.Tensor | Fp8Activation, out: torch.Tensor | None) -> torch.Tensor:
        into = {"out": out} if out is not None and getattr(self.impl, "writes_into", False) else {}
        if self.weight_scale_inv is None:
            y = self.impl.forward(dense(x), self.weight, **into)
        elif isinstance(x, Fp8Activation):  # the norm before quantized x already
            y = self.impl.forward(x.x, self.weight, self.weight_scale_inv, x_fp8=x.fp8, **into)
        else:
            y = self.impl.forward(x, self.weight, self.weight_scale_inv, **into)
        if out is None:
            return y
        if not into:
            out.copy_(y)
        return out


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm, ``forward(x)`` or ``forward(x, residual)`` (fused add). With ``feeds``
    (the block-FP8 weights of the projections it feeds) its output comes as an Fp8Activation: the
    norm writes the quantized copy those projections would otherwise make in a launch of their own."""

    def __init__(self, factory: OpFactory, size: int, eps: float, dtype, device,
                 feeds: Fp8Weights | None = None) -> None:
        super().__init__()
        self.weight = _param(size, dtype=dtype, device=device)
        self.impl = factory.build("norm", NormSpec(**factory.base, hidden_size=size, eps=eps,
                                                   fp8_group=None if feeds is None else feeds.block[1]))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.impl.forward(x, self.weight)
        return self.impl.forward_add(x, residual, self.weight)


class Attention(nn.Module):
    """Gated full attention: q_proj rows are per-head [query | gate] (kept inside ``qkv_proj``);
    q/k norm, RoPE, the cache write, attention and the sigmoid gate are one attention op."""

    def __init__(self, args: ModelArgs, factory: OpFactory, par: TensorParallel, cache_index: int, dtype,
                 device) -> None:
        super().__init__()
        hq, hkv, d = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        tp = par.info
        self.cache_index, self.par = cache_index, par
        quant = args.quantization
        self.fp8_input = fp8_weights(quant, "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        self.qkv_proj = Linear(factory, args.hidden_size, 2 * hq * d + 2 * hkv * d, dtype, device, tp=tp,
                               shard=split(0, (2 * hq * d, hq), (hkv * d, hkv), (hkv * d, hkv)), fp8=self.fp8_input)
        self.o_proj = Linear(factory, hq * d, args.hidden_size, dtype, device, tp=tp, shard=split(1, (hq * d, hq)),
                             fp8=fp8_weights(quant, "self_attn.o_proj"))
        self.q_norm = _param(d, dtype=dtype, device=device)
        self.k_norm = _param(d, dtype=dtype, device=device)
        hq, hkv = hq // tp.world, max(1, hkv // tp.world)  # this rank's heads (KV heads replicated past Hkv ranks)
        spec = AttentionSpec(**factory.base, num_heads=hq, num_kv_heads=hkv, head_dim=d, scale=d**-0.5,
                             rotary_dim=args.rotary_dim, rope_theta=args.rope_theta, norm_eps=args.rms_norm_eps,
                             kv_cache_dtype=args.kv_cache_dtype, kv_scales=args.kv_scales)
        self.attn = factory.build("attention", spec)
        if spec.kv_scales and hasattr(self.attn, "forward") and (  # (explain and sizing build no impl to ask)
                "kv_scales" not in inspect.signature(self.attn.forward).parameters):
            raise BackendSelectionError("attention", [(type(self.attn).__name__, [
                "its forward takes no kv_scales: it cannot store and read an FP8 KV cache at the checkpoint's k/v "
                "scales (kv_cache_scheme); use another attention backend, or cache.kv_cache_dtype auto"])])
        # an FP8 cache at a checkpoint's calibrated scales (kv_cache_scheme): fp32 parameters, read as
        # numbers once loaded (``read_kv_scales``); the op takes them as (k_scale, v_scale)
        self.kv_scales: tuple[float, float] | None = None
        if args.kv_scales:
            self.k_scale = nn.Parameter(torch.ones(1, dtype=torch.float32, device=device), requires_grad=False)
            self.v_scale = nn.Parameter(torch.ones(1, dtype=torch.float32, device=device), requires_grad=False)
            self.kv_scales = (1.0, 1.0)

    def read_kv_scales(self, where: str) -> None:
        """After a load: the scales as numbers, checked (finite and positive: the cache stores x /
        scale). ``where``: this module's name in the model (``layers.3.mixer``), for the error."""
        if self.kv_scales is None:
            return
        k, v = float(self.k_scale.item()), float(self.v_scale.item())
        for name, x in (("k_scale", k), ("v_scale", v)):
            if not (math.isfinite(x) and x > 0):
                raise CheckpointError(f"{where}.{name} (the checkpoint's self_attn.{name} of that layer) is {x}: an "
                                      "FP8 KV cache scale must be finite and positive")
        self.kv_scales = (k, v)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, caches: ModelCaches) -> torch.Tensor:
        i = self.cache_index
        scales = {} if self.kv_scales is None else {"kv_scales": self.kv_scales}
        slots = ctx.lora_slots
        o = self.attn.forward(self.qkv_proj(x, lora_slots=slots), self.q_norm, self.k_norm, caches.k[i], caches.v[i],
                              ctx, **scales)
        return self.par.reduce(self.o_proj(o, lora_slots=slots))


class GatedDeltaNet(nn.Module):
    """Heads split over ranks: ``in_proj`` parts q|k|v|z|b|a and the conv channels q|k|v by head,
    ``out_proj`` row-parallel (value heads stay with their key head: both split contiguously)."""

    def __init__(self, args: ModelArgs, factory: OpFactory, par: TensorParallel, cache_index: int, dtype,
                 device) -> None:
        super().__init__()
        self.cache_index, self.par = cache_index, par
        tp = par.info
        hk, hv = args.linear_num_key_heads, args.linear_num_value_heads
        qk, v = (args.key_dim, hk), (args.value_dim, hv)
        quant, h, rows = args.quantization, args.hidden_size, args.conv_dim + args.value_dim
        fused = split(0, qk, qk, v, v, (hv, hv), (hv, hv))
        self.in_proj_ba = None
        if not splits_gdn_in_proj(quant):
            self.fp8_input = fp8_weights(quant, *GDN_HEAD, *GDN_TAIL)
            self.in_proj = Linear(factory, h, rows + 2 * hv, dtype, device, tp=tp, shard=fused, fp8=self.fp8_input)
        else:  # official FP8: qkv|z in FP8, b|a unquantized: two projections, their outputs side by side
            self.fp8_input = fp8_weights(quant, *GDN_HEAD)
            self.in_proj = Linear(factory, h, rows, dtype, device, tp=tp, shard=split(0, qk, qk, v, v),
                                  fp8=self.fp8_input)
            self.in_proj_ba = Linear(factory, h, 2 * hv, dtype, device, tp=tp, shard=split(0, (hv, hv), (hv, hv)),
                                     fp8=fp8_weights(quant, *GDN_TAIL))
            _draw_together(self.in_proj.weight, self.in_proj_ba.weight, (rows + 2 * hv, h), fused, tp)
        self.conv1d = _param(args.conv_dim, args.linear_conv_kernel_dim, dtype=dtype, device=device, tp=tp,
                             shard=split(0, qk, qk, v))
        self.A_log = _param(hv, dtype=torch.float32, device=device, tp=tp, shard=split(0, hv))
        self.dt_bias = _param(hv, dtype=torch.float32, device=device, tp=tp, shard=split(0, hv))
        self.norm_weight = _param(args.linear_value_head_dim, dtype=dtype, device=device)
        self.out_proj = Linear(factory, args.value_dim, args.hidden_size, dtype, device, tp=tp, shard=split(1, v),
                               fp8=fp8_weights(quant, "linear_attn.out_proj"))
        self.gdn = factory.build("gdn", GdnSpec(
            **factory.base, num_k_heads=hk // tp.world, num_v_heads=hv // tp.world,
            head_k_dim=args.linear_key_head_dim, head_v_dim=args.linear_value_head_dim,
            conv_kernel=args.linear_conv_kernel_dim, norm_eps=args.rms_norm_eps))

    def forward(self, x: torch.Tensor, ctx: ForwardContext, caches: ModelCaches) -> torch.Tensor:
        i = self.cache_index
        weights = GdnWeights(self.conv1d, self.A_log, self.dt_bias, self.norm_weight)
        slots = ctx.lora_slots
        if self.in_proj_ba is None:
            proj = self.in_proj(x, lora_slots=slots)
        else:  # official FP8: the two projections write their columns of one buffer (no concatenation)
            rows, xd = self.in_proj.weight.shape[0], dense(x)
            proj = torch.empty((xd.shape[0], rows + self.in_proj_ba.weight.shape[0]), dtype=xd.dtype, device=xd.device)
            self.in_proj(x, out=proj[:, :rows], lora_slots=slots)
            self.in_proj_ba(x, out=proj[:, rows:], lora_slots=slots)
        o = self.gdn.forward(proj, weights, caches.conv[i], caches.recurrent[i], ctx)
        return self.par.reduce(self.out_proj(o, lora_slots=slots))


class MLP(nn.Module):
    def __init__(self, factory: OpFactory, par: TensorParallel, hidden: int, intermediate: int, dtype,
                 device, quant=None) -> None:
        super().__init__()
        self.par = par
        self.fp8_input = fp8_weights(quant, "mlp.gate_proj", "mlp.up_proj")
        self.gate_up_proj = Linear(factory, hidden, 2 * intermediate, dtype, device, silu_mul=True, tp=par.info,
                                   shard=split(0, intermediate, intermediate), fp8=self.fp8_input)
        self.down_proj = Linear(factory, intermediate, hidden, dtype, device, tp=par.info,
                                shard=split(1, intermediate), fp8=fp8_weights(quant, "mlp.down_proj"))

    def forward(self, x: torch.Tensor | Fp8Activation, lora_slots: torch.Tensor | None = None) -> torch.Tensor:
        return self.par.reduce(self.down_proj(self.gate_up_proj(x, lora_slots=lora_slots), lora_slots=lora_slots))


class SparseMoE(nn.Module):
    """Softmax top-k router (renormalised), routed SwiGLU experts and a sigmoid-gated shared
    expert. The shared expert is stored as expert E of ``w13``/``w2`` and its gate as row E of the
    router (so one GEMM gives both logits, and the grouped GEMMs run it with the routed experts);
    experts of different widths are zero-padded to the widest: zero gate/up rows give zero
    activations and zero down columns add nothing, so a padded expert computes exactly the same."""

    def __init__(self, args: ModelArgs, factory: OpFactory, par: TensorParallel, dtype, device) -> None:
        super().__init__()
        e, h = args.num_experts, args.hidden_size
        self.num_experts, self.par = e, par
        self.shared = args.shared_expert_intermediate_size > 0
        self.widths = (args.moe_intermediate_size, args.shared_expert_intermediate_size)  # routed, shared
        i = max(self.widths)
        experts = e + (1 if self.shared else 0)
        self.gate = Linear(factory, h, experts, dtype, device)
        tp = par.info  # experts split by intermediate size: gate|up rows column-parallel, down row-parallel
        self.fp8 = self.fp8_input = fp8_weights(args.quantization, *(MOE if self.shared else MOE[:1]))
        if self.fp8 is None:
            self.w13 = _param(experts, 2 * i, h, dtype=dtype, device=device, tp=tp, shard=split(1, i, i))
            self.w2 = _param(experts, h, i, dtype=dtype, device=device, tp=tp, shard=split(2, i))
            self.w13_scale_inv = self.w2_scale_inv = None
        else:
            self.w13, self.w13_scale_inv = _fp8_param((experts, 2 * i, h), self.fp8, dtype, device, tp, split(1, i, i))
            self.w2, self.w2_scale_inv = _fp8_param((experts, h, i), self.fp8, dtype, device, tp, split(2, i))
            if self.widths[0] != self.widths[1]:  # a random init zeroes the padding before quantizing
                self.w13.zero_pad = lambda t: self._zero_padding(t, self.w13.shape[1] // 2, 1)
                self.w2.zero_pad = lambda t: self._zero_padding(t, self.w2.shape[2], 2)
        i = self.w2.shape[2]
        self.topk = factory.build("topk", TopKSpec(**factory.base, num_experts=e, top_k=args.num_experts_per_tok))
        self.spec = MoESpec(**factory.base, num_experts=e, top_k=args.num_experts_per_tok, hidden_size=h,
                            intermediate_size=i, shared_expert=self.shared, **_spec_format(self.fp8))
        self.experts = factory.build("moe", self.spec)
        self.lora = None  # an ExpertTarget with lora.experts (bi_core/lora/experts.py)
        self.route_log: torch.Tensor | None = None  # [max tokens, k]: this layer's expert ids land here (routing replay)

    @torch.no_grad()
    def zero_padding(self) -> None:
        """Zero the padded rows/columns of narrower experts (after random initialisation); this
        rank's columns start at ``rank * width`` of the full width."""
        width = self.w2.shape[2]
        self._zero_padding(self.w13, width, 1)
        self._zero_padding(self.w2, width, 2)

    @torch.no_grad()
    def _zero_padding(self, t: torch.Tensor, width: int, dim: int) -> None:
        """Zero the padding of ``t``, laid out like this rank's w13 (``dim`` 1: gate and up rows)
        or w2 (``dim`` 2: down columns)."""
        e, start = self.num_experts, self.par.info.rank * width
        for sl, size in ((slice(0, e), self.widths[0]), (slice(e, e + 1), self.widths[1])):
            keep = max(0, min(width, size - start))
            if dim == 1:
                t[sl, keep:width].zero_()
                t[sl, width + keep:].zero_()
            else:
                t[sl, :, keep:].zero_()

    def forward(self, x: torch.Tensor | Fp8Activation, lora_slots: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.gate(x, lora_slots=lora_slots)
        weights, ids = self.topk.forward(logits[:, : self.num_experts])
        if self.route_log is not None:
            self.route_log[: ids.shape[0]].copy_(ids)
        shared = logits[:, self.num_experts] if self.shared else None
        if self.lora is not None:  # (dense experts only: lora/experts.py refuses FP8 ones)
            lora = self.lora.bind(ids, lora_slots)
            return self.par.reduce(self.experts.forward(dense(x), weights, ids, self.w13, self.w2, shared, lora=lora))
        if self.fp8 is None:
            return self.par.reduce(self.experts.forward(dense(x), weights, ids, self.w13, self.w2, shared))
        quantized = {"x_fp8": x.fp8} if isinstance(x, Fp8Activation) else {}  # the norm's copy
        return self.par.reduce(self.experts.forward(dense(x), weights, ids, self.w13, self.w2, shared,
                                                    w13_scale=self.w13_scale_inv, w2_scale=self.w2_scale_inv,
                                                    **quantized))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, factory: OpFactory, par: TensorParallel, layer_type: str, cache_index: int,
                 dtype, device) -> None:
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "full_attention":
            mixer = Attention(args, factory, par, cache_index, dtype, device)
        else:
            mixer = GatedDeltaNet(args, factory, par, cache_index, dtype, device)
        if args.is_moe:
            mlp = SparseMoE(args, factory, par, dtype, device)
        else:
            mlp = MLP(factory, par, args.hidden_size, args.intermediate_size, dtype, device, args.quantization)
        # each norm feeds its block's first projections (their FP8 copy comes from it); registered
        # first, as ever: parameter order is the random initialiser's draw order
        self.input_layernorm = RMSNorm(factory, args.hidden_size, args.rms_norm_eps, dtype, device, mixer.fp8_input)
        self.post_attention_layernorm = RMSNorm(factory, args.hidden_size, args.rms_norm_eps, dtype, device,
                                                mlp.fp8_input)
        self.mixer, self.mlp = mixer, mlp

    def forward(self, x, residual, ctx, caches):
        h, residual = (self.input_layernorm(x), x) if residual is None else self.input_layernorm(x, residual)
        h = self.mixer(h, ctx, caches)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h, ctx.lora_slots), residual


class MtpHead(nn.Module):
    """``fc([norm(emb(next token)), norm(hidden)])`` -> one gated-attention decoder layer (own KV
    cache) -> ``mtp.norm``; logits through the main model's lm_head."""

    def __init__(self, args: ModelArgs, factory: OpFactory, par: TensorParallel, dtype, device) -> None:
        super().__init__()
        h, eps = args.hidden_size, args.rms_norm_eps
        if args.quantization is not None:  # the MTP head's own FP8 kinds (the official releases keep fc in bf16)
            args = attrs.evolve(args, quantization=args.quantization.for_mtp())
        self.pre_fc_norm_embedding = RMSNorm(factory, h, eps, dtype, device)
        self.pre_fc_norm_hidden = RMSNorm(factory, h, eps, dtype, device)
        self.fc = Linear(factory, 2 * h, h, dtype, device, fp8=fp8_weights(args.quantization, MTP_FC))
        self.layer = DecoderLayer(args, factory, par, "full_attention", 0, dtype, device)
        self.norm = RMSNorm(factory, h, eps, dtype, device)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext, caches: ModelCaches):
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        h, residual = self.layer(x, None, ctx, caches)
        return self.norm(h, residual)[0]


class Qwen35Model(nn.Module):
    def __init__(self, args: ModelArgs, factory: OpFactory, dtype: torch.dtype, device: torch.device,
                 with_mtp: bool = True, tp: TPInfo = NO_TP) -> None:
        super().__init__()
        self.args, self.dtype, self.device = args, dtype, device
        self.par = par = TensorParallel(factory, tp)
        vocab = split(0, args.vocab_size)  # vocabulary-parallel embedding and lm_head
        self.embed_tokens = _param(args.vocab_size, args.hidden_size, dtype=dtype, device=device, tp=tp, shard=vocab)
        attn_index = {layer: n for n, layer in enumerate(args.full_attention_layers)}
        gdn_index = {layer: n for n, layer in enumerate(args.gdn_layers)}
        self.layers = nn.ModuleList(
            DecoderLayer(args, factory, par, t, attn_index.get(i, gdn_index.get(i)), dtype, device)
            for i, t in enumerate(args.layer_types)
        )
        self.norm = RMSNorm(factory, args.hidden_size, args.rms_norm_eps, dtype, device)
        self.lm_head = None if args.tie_word_embeddings else Linear(
            factory, args.hidden_size, args.vocab_size, dtype, device, tp=tp, shard=vocab)
        self._tied_head = None if self.lm_head is not None else factory.build(
            "linear", LinearSpec(**factory.base, in_features=args.hidden_size, out_features=self.embed_tokens.shape[0]))
        self.sampler = factory.build("sampling", SamplingSpec(**factory.base, vocab_size=args.vocab_size))
        self.mtp = MtpHead(args, factory, par, dtype, device) if with_mtp and args.mtp_num_hidden_layers else None
        self.draft_ids: torch.Tensor | None = None  # MTP drafts among these ids only (set_draft_vocab)
        self.draft_weight: torch.Tensor | None = None
        self.lora_targets: dict = {}  # projection path -> LoraTarget, when the engine serves adapters (bi_core/lora)
        impls = {id(m.attn): m.attn for m in self.modules() if isinstance(m, Attention)}
        self._step_planners = [i for i in impls.values() if hasattr(i, "prepare")]

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext, caches: ModelCaches
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat batch of token ids ``[T]`` -> (hidden states after the final norm ``[T, H]``, logits of
        the rows ``ctx.logits_indices``)."""
        ctx.step_tensors = {}  # derived anew by this forward (a graph's warm-up and capture share a context)
        x, residual = self.embed_with_vision(input_ids, ctx), None
        for layer in self.layers:
            x, residual = layer(x, residual, ctx, caches)
        hidden = self.norm(x, residual)[0]
        return hidden, self.compute_logits(_logits_rows(hidden, ctx))

    @property
    def plans_from_host_lengths(self) -> bool:
        """Whether an impl plans each graph replay from the host's context lengths (FlashInfer),
        so a context whose lengths only the device knows cannot run (``ModelRunner.shifts_on_device``)."""
        return any(getattr(i, "plans_from_host_lengths", False) for i in self._step_planners)

    def prepare_step(self, ctx: ForwardContext) -> None:
        """Host-side per-step planning of impls that need it (e.g. FlashInfer), outside any graph."""
        for impl in self._step_planners:
            impl.prepare(ctx)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows; vocabulary-parallel: each rank looks up the ids in its slice (zero rows
        for the others) and the sum over ranks (x + 0 + ...: exact) gives every rank the row."""
        if self.par.info.world == 1:
            return self.embed_tokens[input_ids]
        rows = self.embed_tokens.shape[0]
        local = input_ids - self.par.info.rank * rows
        inside = (local >= 0) & (local < rows)
        x = self.embed_tokens[local.clamp(0, rows - 1)].masked_fill(~inside[:, None], 0)
        return self.par.reduce(x)

    def embed_with_vision(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Token embeddings, the rows ``ctx.embed_rows`` replaced by the vision tower's ``ctx.embeds``."""
        x = self.embed(input_ids)
        if ctx.embed_rows is not None:
            x[ctx.embed_rows] = ctx.embeds.to(x.dtype)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary (vocabulary-parallel: each rank's columns, gathered)."""
        if self.lm_head is not None:
            return self.par.gather(self.lm_head(hidden))
        return self.par.gather(self._tied_head.forward(hidden, self.embed_tokens))

    def mtp_forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext,
                    caches: ModelCaches) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP head on rows (next token, main hidden of the previous position): (its output
        ``[T, H]``, the greedy draft token of each ``ctx.logits_indices`` row)."""
        ctx.step_tensors = {}
        m = self.mtp(self.embed_with_vision(input_ids, ctx), hidden, ctx, caches)
        rows = _logits_rows(m, ctx)
        if self.draft_ids is None:
            return m, torch.argmax(self.compute_logits(rows), dim=-1)
        return m, self.draft_ids[torch.argmax(self._draft_head.forward(rows, self.draft_weight), dim=-1)]

    def moe_layers(self) -> list[SparseMoE]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoE)]

    def log_routing(self, buffer: torch.Tensor | None) -> None:
        """Every main-model MoE layer copies its top-k expert ids into its row of ``buffer``
        ``[moe layers, max tokens, k]`` (inside CUDA graphs too); None stops it. The MTP head's
        layer is not logged (its routing is not the model's)."""
        for i, moe in enumerate(self.moe_layers()):
            moe.route_log = buffer[i] if buffer is not None else None

    def set_draft_vocab(self, ids: torch.Tensor, head) -> None:
        """MTP drafts choose among ``ids`` only (``strategies/draft_vocab.py``): their lm_head rows
        are copied once (again after a weight update: ``refresh_draft_head``) and multiplied by
        ``head``, a linear op of that many outputs. One rank only (the lm_head is whole)."""
        self.draft_ids, self._draft_head = ids, head
        self.draft_weight = torch.empty((len(ids), self.args.hidden_size), dtype=self.dtype, device=self.device)
        self.refresh_draft_head()

    def refresh_draft_head(self) -> None:
        """Copy the draft vocabulary's lm_head rows again (in place: captured graphs keep reading it)."""
        if self.draft_ids is not None:
            full = self.lm_head.weight if self.lm_head is not None else self.embed_tokens
            self.draft_weight.copy_(full.detach().index_select(0, self.draft_ids))


def local_args(args: ModelArgs, world: int) -> ModelArgs:
    """The head counts one rank holds (what its KV cache and GDN states are sized by)."""
    if world == 1:
        return args
    return attrs.evolve(args, num_key_value_heads=max(1, args.num_key_value_heads // world),
                        linear_num_key_heads=args.linear_num_key_heads // world,
                        linear_num_value_heads=args.linear_num_value_heads // world)


def check_tensor_parallel(args: ModelArgs, world: int) -> None:
    """Raise a ConfigError naming every dimension that cannot be split over ``world`` ranks."""
    from bi_core.errors import ConfigError

    if world == 1:
        return
    hkv = args.num_key_value_heads
    sizes = {"num_attention_heads": args.num_attention_heads, "linear_num_key_heads": args.linear_num_key_heads,
             "linear_num_value_heads": args.linear_num_value_heads, "vocab_size": args.vocab_size,
             ("moe_intermediate_size" if args.is_moe else "intermediate_size"):
                 args.moe_intermediate_size if args.is_moe else args.intermediate_size}
    if args.is_moe and args.shared_expert_intermediate_size:
        sizes["shared_expert_intermediate_size"] = args.shared_expert_intermediate_size
    bad = [f"{k}={v}" for k, v in sizes.items() if v % world]
    if hkv % world and world % hkv:
        bad.append(f"num_key_value_heads={hkv} (neither divides the other)")
    if bad:
        raise ConfigError("parallel.tensor_parallel_size", f"{world} ranks cannot split this model: "
                          f"{', '.join(bad)} not divisible by {world}")


def _logits_rows(hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
    return hidden if ctx.logits_all_rows else hidden[ctx.logits_indices]
