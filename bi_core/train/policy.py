"""``PolicyModel``: the policy a trainer optimises, whose forward computes completion logprobs with
the bits the engine reported when it sampled them.

Its parameters carry Hugging Face names and layout (``model.layers.N.self_attn.q_proj.weight``,
fused experts ``mlp.experts.gate_up_proj``), so ``engine.update_weights(policy.state_dict())``
syncs it and any checkpoint the engine loads loads here. Its forward builds the engine's fused
parameters from them (differentiable) and runs the engine's own model classes with the op
impls the engine's config selects, each wrapped with a backward (``train/ops.py``), over one
layout of the batch that reproduces the engine's arithmetic per token (``train/layout.py``)."""

from __future__ import annotations

import math
from pathlib import Path

import attrs
import torch
from torch import nn
from torch.func import functional_call

from bi_core.config import EngineConfig
from bi_core.errors import ConfigError, RequestError
from bi_core.models.loader import load_weights
from bi_core.models.qwen3_5 import DecoderLayer, Qwen35Model
from bi_core.models.random_init import init_random_weights
from bi_core.ops.attention import kv_cache_torch_dtype
from bi_core.ops.context import ModelCaches
from bi_core.policies.apply import applied
from bi_core.quant.params import SCALE_SUFFIX, is_fp8
from bi_core.runtime.build import prepare, resolve_max_model_len, resolve_model
from bi_core.runtime.scheduler import resolve_chunk_size
from bi_core.train import adapter as adapters
from bi_core.train import ops
from bi_core.train.layout import TrainContext, plan_train
from bi_core.train.weights import FusionPlan, fuse, fuse_fp8, fusion_plan, unfuse


class _Node(nn.Module):
    """A level of the Hugging Face name tree (``model``, ``self_attn``...), holding parameters."""


def _attach(root: nn.Module, name: str, value: torch.Tensor) -> None:
    *path, leaf = name.split(".")
    node = root
    for part in path:
        if not hasattr(node, part):
            node.add_module(part, _Node())
        node = getattr(node, part)
    node.register_parameter(leaf, nn.Parameter(value))


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return dict(module.named_parameters())


@attrs.frozen
class _Shape:
    """What the layout of a batch needs from the engine's config."""

    chunk_size: int
    decode_tokens: int | None
    block_size: int
    vocab_size: int
    max_len: int


class PolicyLayer(nn.Module):
    """One decoder layer's parameters (HF names relative to ``model.layers.N``), and its forward: the
    engine's layer over the engine parameters fused from them. With ``checkpoint``, only the layer's
    inputs are kept for the backward, which recomputes the layer's mathematics (``ops.math_mode``)."""

    def __init__(self, tensors: dict[str, torch.Tensor], plan: FusionPlan, engine_layer: DecoderLayer,
                 compute_dtype: torch.dtype, lora: adapters.LayerAdapter | None = None,
                 lora_tensors: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        super().__init__()
        for name, t in tensors.items():
            _attach(self, name, t)
        for name, (a, b) in (lora_tensors or {}).items():  # PEFT's module tree: q_proj.lora_A.weight
            _attach(self, f"{name}.lora_A.weight", a)
            _attach(self, f"{name}.lora_B.weight", b)
        self._lora = lora
        self._plan, self._dtype = plan, compute_dtype
        self._meta = dict(engine_layer.named_parameters())  # shapes, and FP8 parameters' formats
        object.__setattr__(self, "_engine_layer", engine_layer)  # not a submodule: its parameters are meta
        self.checkpoint = True

    def engine_params(self) -> dict[str, torch.Tensor]:
        """The engine layer's parameters from this layer's: fused (differentiable); an FP8 one
        quantized as a weight sync quantizes it, its fused bf16 weights kept as ``.dense`` (the
        backward differentiates them: the straight-through estimator)."""
        hf, out = _tensors(self), {}
        for name, pieces in self._plan.pieces.items():
            meta = self._meta[name]
            # in the engine parameter's dtype (the model's, or float32 for GDN's A_log / dt_bias);
            # an FP8 one's dense copy in the model's
            dense = fuse(meta.shape, pieces, hf, self._dtype if is_fp8(meta) else meta.dtype)
            if not is_fp8(meta):
                out[name] = dense
                continue
            q, scale = fuse_fp8(meta, pieces, hf, self._plan.place_shapes)
            q.dense = dense
            out[name], out[name + SCALE_SUFFIX] = q, scale
        return out

    def run(self, x, residual, ctx: TrainContext, caches: ModelCaches):
        if self._lora is not None:
            self._lora.fill(_tensors(self))  # the adapter's stacks from A and B (differentiable)
        return functional_call(self._engine_layer, self.engine_params(), (x, residual, ctx, caches))

    def forward(self, x, residual, ctx: TrainContext, caches: ModelCaches):
        if not (self.checkpoint and torch.is_grad_enabled()):
            return self.run(x, residual, ctx, caches)
        params = tuple(self.parameters())
        return _Checkpointed.apply(self, ctx, caches, x, residual, *params)


class _Checkpointed(torch.autograd.Function):
    """A layer's forward through its kernels, saving its inputs only; its backward recomputes the
    layer's mathematics under autograd (the parameters are those of ``layer``, in order)."""

    @staticmethod
    def forward(fctx, layer: PolicyLayer, ctx, caches, x, residual, *params):
        fctx.layer, fctx.ctx, fctx.caches = layer, ctx, caches
        fctx.has_residual = residual is not None
        fctx.save_for_backward(x, *((residual,) if residual is not None else ()))
        return layer.run(x, residual, ctx, caches)

    @staticmethod
    def backward(fctx, gh, gr):
        layer, saved = fctx.layer, fctx.saved_tensors
        x = saved[0].detach().requires_grad_()
        residual = saved[1].detach().requires_grad_() if fctx.has_residual else None
        needs = fctx.needs_input_grad[5:]  # frozen parameters (a LoRA trainer's base weights) get none
        params = [p for p, n in zip(layer.parameters(), needs) if n]
        with torch.enable_grad(), ops.math_mode():
            h, r = layer.run(x, residual, fctx.ctx, fctx.caches)
        inputs = [x] + ([residual] if residual is not None else []) + params
        outs = [(o, g) for o, g in ((h, gh), (r, gr)) if g is not None]
        grads = torch.autograd.grad([o for o, _ in outs], inputs, [g for _, g in outs], allow_unused=True)
        gx, grads = grads[0], grads[1:]
        g_res = grads[0] if residual is not None else None
        rest = iter(grads[1 if residual is not None else 0:])
        return (None, None, None, gx, g_res, *(next(rest) if n else None for n in needs))


class PolicyModel(nn.Module):
    """Qwen3.5 (dense or MoE) as a trainable module: ``token_logprobs(prompts, completions)`` gives
    every completion token's logprob, differentiable; on the invariant backend, bitwise what the
    engine with the same config and weights reported when it sampled those tokens.

    ``lora``: PEFT's adapter_config dict (``r``, ``lora_alpha``, ``target_modules``, ``use_rslora``):
    the policy trains that adapter (its A and B in ``lora_dtype``, from ``lora_tensors`` in PEFT's
    names or PEFT's initialisation seeded by ``lora_seed``), the base weights frozen; its logprobs
    are those of the engine's requests on that adapter (the config's ``lora`` section: the rollout
    engine's). A config with ``lora.max_loras`` > 0 and no ``lora``: those of its requests without one."""

    def __init__(self, config: EngineConfig, registry=None, *, param_dtype: torch.dtype | None = None,
                 lora: dict | None = None, lora_tensors: dict[str, torch.Tensor] | None = None, lora_seed: int = 0,
                 lora_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if config.parallel.tensor_parallel_size != 1:
            raise ConfigError("parallel.tensor_parallel_size", "the trainer's forward runs on one GPU; build it from "
                              "the rollout config with tensor_parallel_size 1 (docs/rl.md says when the bits agree)")
        registry, policy, factory = prepare(config, registry)
        args, index = resolve_model(config)
        if args.kv_scales:
            raise ConfigError("cache.kv_cache_dtype", "an FP8 KV cache at a checkpoint's calibrated k/v scales is not "
                              "trained yet; use cache.kv_cache_dtype auto or an FP8 cache at scale 1")
        if index is not None and any(index.dtype(n) == torch.float8_e4m3fn for n in index.names()):
            raise ConfigError("model.path", "an FP8 checkpoint: the trainer holds bf16 weights and quantizes them as a "
                              "weight sync does; start it from the bf16 checkpoint with model.quantization: fp8")
        self.config, self.args, self._policy = config, args, policy
        self.device, self.dtype = factory.base["device"], factory.base["dtype"]
        param_dtype = param_dtype or self.dtype
        train_factory = ops.TrainFactory(factory)
        engine = Qwen35Model(args, train_factory, self.dtype, torch.device("meta"), with_mtp=False)
        object.__setattr__(self, "_engine", engine)
        self._adapter, layer_lora, lora_init = adapters.build(config, engine, train_factory, lora, lora_tensors,
                                                              lora_seed, lora_dtype)
        plan = fusion_plan(args)
        hf = _initial_weights(config, args, factory, index, param_dtype)
        self.model = _Node()
        _attach(self.model, "embed_tokens.weight", hf.pop("model.embed_tokens.weight"))
        _attach(self.model, "norm.weight", hf.pop("model.norm.weight"))
        if not args.tie_word_embeddings:
            _attach(self, "lm_head.weight", hf.pop("lm_head.weight"))
        self.model.layers = nn.ModuleList(
            PolicyLayer({n[len(f"model.layers.{i}."):]: t for n, t in hf.items() if n.startswith(f"model.layers.{i}.")},
                        plan.layer(i), engine.layers[i], self.dtype, layer_lora.get(i), lora_init.get(i))
            for i in range(args.num_hidden_layers))
        if self._adapter is not None:  # the base weights are frozen: only A and B train
            for name, p in self.named_parameters():
                p.requires_grad_(adapters.is_adapter_param(name))
        registry_strategy = registry.strategies[config.strategy.name]
        limits = [m.attn.decode_query_len for m in engine.modules() if getattr(m, "attn", None) is not None]
        self._shape = _Shape(
            chunk_size=resolve_chunk_size(config.scheduler, registry_strategy.decode_tokens_for(config),
                                          config.cache.block_size),
            decode_tokens=min((q for q in limits if q), default=None), block_size=config.cache.block_size,
            vocab_size=args.vocab_size, max_len=resolve_max_model_len(config, args))

    @classmethod
    def from_config(cls, config: EngineConfig, registry=None, **kw) -> PolicyModel:
        """The policy of an engine config's ``model`` section (a checkpoint or a random preset: the
        same weights the engine starts from), its backend and its scheduler's chunk grid."""
        return cls(config, registry, **kw)

    @property
    def checkpoint_layers(self) -> bool:
        return all(layer.checkpoint for layer in self.model.layers)

    @checkpoint_layers.setter
    def checkpoint_layers(self, on: bool) -> None:
        for layer in self.model.layers:
            layer.checkpoint = on

    def plan(self, prompts, completions) -> TrainContext:
        s = self._shape
        ctx = plan_train(prompts, completions, chunk_size=s.chunk_size, decode_tokens=s.decode_tokens,
                         block_size=s.block_size, vocab_size=s.vocab_size, max_len=s.max_len, device=self.device)
        if self._adapter is not None:  # every row on the adapter's slot (0: the trainer's only one)
            ctx.lora_slots = torch.zeros_like(ctx.input_ids)
        return ctx

    def adapter_config(self) -> dict:
        """The trained adapter's ``adapter_config.json`` (PEFT's), for ``engine.load_lora_adapter``."""
        if self._adapter is None:
            raise ValueError("adapter_config: this policy trains no LoRA adapter (build it with lora=...)")
        path = self.config.model.path
        return self._adapter.config(None if path is None else str(path))

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The trained adapter's A and B in PEFT's names (``base_model.model.<module>.lora_A.weight``),
        detached copies: ``engine.load_lora_adapter(name, tensors=..., config=adapter_config())``
        serves them as the name's next version."""
        self.adapter_config()  # (refuses a policy without one)
        return {adapters.PREFIX + n: p.detach().clone() for n, p in self.named_parameters()
                if adapters.is_adapter_param(n)}

    def save_adapter(self, path) -> Path:
        """The adapter as PEFT's ``save_pretrained`` writes it (the engine's and PEFT's loaders read it)."""
        return adapters.save_adapter(path, self.adapter_config(), self.adapter_tensors())

    def base_state_dict(self) -> dict[str, torch.Tensor]:
        """The state dict without the adapter's tensors: the base weights, in Hugging Face names."""
        return {n: t for n, t in self.state_dict().items() if not adapters.is_adapter_param(n)}

    def forward(self, ctx: TrainContext, temperature: float = 1.0) -> torch.Tensor:
        """The logprobs of every completion token of the planned batch, flat ``[sum C]``, under the
        mode's process settings, as the engine's steps run (``policies.apply``)."""
        with applied(self._policy):
            return self._forward(ctx, temperature)

    def _forward(self, ctx: TrainContext, temperature: float) -> torch.Tensor:
        caches = self._caches(ctx)
        x, residual = self.model.embed_tokens.weight[ctx.input_ids].to(self.dtype), None
        for layer in self.model.layers:
            x, residual = layer(x, residual, ctx, caches)
        final = functional_call(self._engine.norm, {"weight": self.model.norm.weight.to(self.dtype)}, (x, residual))
        hidden = final[0][ctx.logits_indices]
        if self.args.tie_word_embeddings:
            head, weight = self._engine._tied_head, self.model.embed_tokens.weight
        else:
            head, weight = self._engine.lm_head.impl, self.lm_head.weight
        return ops.HeadLogprobFn.apply(head.impl, self._engine.sampler.impl, float(temperature), hidden,
                                       weight.to(self.dtype), ctx.targets)

    def token_logprobs(self, prompts, completions, temperature: float = 1.0) -> list[torch.Tensor]:
        """Per sequence, the logprob of each completion token ``[C_i]`` (float32, differentiable),
        under the model's distribution at ``temperature``: 1.0, the raw one the engine reports by
        default; another, what a request with that temperature and ``logprobs_mode="temperature"``
        reports (both bitwise on the invariant backend)."""
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
            raise RequestError(f"token_logprobs: temperature must be a finite number > 0, got {temperature!r}")
        ctx = self.plan(prompts, completions)
        return list(torch.split(self(ctx, temperature), ctx.completion_lens))

    def _caches(self, ctx: TrainContext) -> ModelCaches:
        """Fresh, zeroed caches for the batch (pages and state slots, as the engine's cache holds them)."""
        a, dev, n = self.args, self.device, len(ctx.spans)
        kv_dtype = kv_cache_torch_dtype(a.kv_cache_dtype, self.dtype)
        kv_shape = (ctx.num_blocks, self._shape.block_size, a.num_key_value_heads, a.head_dim)
        state_dtype = getattr(torch, self.config.cache.ssm_state_dtype)
        num_attn, num_gdn = len(a.full_attention_layers), len(a.gdn_layers)
        return ModelCaches(
            k=[torch.zeros(kv_shape, dtype=kv_dtype, device=dev) for _ in range(num_attn)],
            v=[torch.zeros(kv_shape, dtype=kv_dtype, device=dev) for _ in range(num_attn)],
            conv=[torch.zeros(n, a.conv_dim, a.linear_conv_kernel_dim - 1, dtype=self.dtype, device=dev)
                  for _ in range(num_gdn)],
            recurrent=[torch.zeros(n, a.linear_num_value_heads, a.linear_value_head_dim, a.linear_key_head_dim,
                                   dtype=state_dtype, device=dev) for _ in range(num_gdn)])


def _initial_weights(config: EngineConfig, args, factory, index, dtype) -> dict[str, torch.Tensor]:
    """The weights the engine starts from (its loader or its random initialiser), in HF names.
    FP8: the unquantized ones (a random preset draws the same numbers for both models; the engine
    quantizes them on load, the trainer at every forward)."""
    device = factory.base["device"]
    args = attrs.evolve(args, quantization=None)
    plan = fusion_plan(args)
    model = Qwen35Model(args, factory, factory.base["dtype"], device, with_mtp=False)
    if index is not None:
        load_weights(model, index)
    else:
        init_random_weights(model, config.model.random.seed)
    weights = unfuse(plan, dict(model.named_parameters()), dtype)
    del model
    return weights
