"""Building an engine's parts from a config: the registry, policy and op factory every entry point
shares (``prepare``), the model's shape (``resolve_model``), what the cache may hold
(``prefix_caching``), and ``explain`` (which builder serves each op, without building the model)."""

from __future__ import annotations

import logging

import attrs
import torch

from bi_core.config import EngineConfig
from bi_core.errors import BiEngineError, ConfigError
from bi_core.models.args import ModelArgs
from bi_core.models.loader import CheckpointIndex, load_weights, read_config
from bi_core.models.presets import preset_args
from bi_core.models.qwen3_5 import Qwen35Model, check_tensor_parallel, local_args
from bi_core.models.random_init import init_random_weights
from bi_core.ops.attention import kv_cache_dtype_name
from bi_core.parallel.lockstep import rank_device
from bi_core.parallel.shard import TPInfo
from bi_core.plugins import load_registry
from bi_core.policies import check_config, make_policy, planned_device, resolve_device
from bi_core.policies.apply import check_environment
from bi_core.policies.base import Policy
from bi_core.registry import Registry
from bi_core.runtime.cache import CacheManager
from bi_core.runtime.graphs import GraphRunnerSpec
from bi_core.runtime.graphs.mode import capture_refusals, explain_line, mixed_fields, resolve_capture
from bi_core.runtime.prefix_cache import PrefixCache
from bi_core.runtime.runner import ModelRunner
from bi_core.runtime.scheduler import Scheduler, resolve_chunk_size
from bi_core.runtime.vision_inputs import build_vision
from bi_core.selector import OpFactory

log = logging.getLogger(__name__)


def resolve_model(config: EngineConfig) -> tuple[ModelArgs, CheckpointIndex | None]:
    quantization = config.model.quantization
    kv = {"kv_cache_dtype": kv_cache_dtype_name(config.cache.kv_cache_dtype)}
    if config.model.random is not None:
        r = config.model.random
        return attrs.evolve(preset_args(r.preset, r.num_hidden_layers, quantization), **kv), None
    args = attrs.evolve(ModelArgs.from_hf_config(read_config(config.model.path), quantization), **kv)
    if args.quantization is not None and args.quantization.kv_scales and not args.kv_scales:
        log.info("the checkpoint's k/v scales (kv_cache_scheme) are not used: they scale an FP8 KV cache, and "
                 "cache.kv_cache_dtype is %s", config.cache.kv_cache_dtype)
    return args, CheckpointIndex(config.model.path)


def builds_mtp_head(strategy_cls, args: ModelArgs, index: CheckpointIndex | None) -> bool:
    """Whether the model holds an MTP head: only for a strategy that runs it (as vLLM loads one only
    for speculative decoding; its weights are 2-5 GiB on the larger MoE shapes), and only where the
    checkpoint (or the preset) has one. An AR engine skips a checkpoint's ``mtp.*`` tensors and a
    weight update's."""
    has = index.has_prefix("mtp.") if index is not None else args.mtp_num_hidden_layers > 0
    return has and strategy_cls.uses_mtp_head


def prepare(config: EngineConfig, registry: Registry | None, *, live: bool = True, plan_only: bool = False,
            rank: int = 0):
    """The steps every entry point shares: registry, policy, device, config checks, op factory.
    ``live=False`` (explain on a machine without the configured GPU): the device is taken as
    configured and the checks that need it present are skipped. ``rank``: the tensor-parallel
    rank, whose device is the configured one plus ``rank``."""
    if config.parallel.data_parallel_size > 1 and not plan_only:
        raise ConfigError("parallel.data_parallel_size", f"{config.parallel.data_parallel_size}: replicas are "
                          "processes of their own, started by `bi-engine serve` (Ray and sglang-router: "
                          "docs/scale-out.md); an engine built in this process is one replica (use 1 here)")
    registry = registry or load_registry()
    policy = make_policy(batch_invariant=config.policy.batch_invariant, backend=config.backend,
                         op_overrides=config.policy.ops, device=planned_device(config.model.device))
    device = resolve_device(config.model.device) if live else planned_device(config.model.device)
    device = rank_device(device, rank)
    check_config(config, policy, registry, device, live=live)
    if live:
        check_environment(policy, device)
    return registry, policy, OpFactory(registry, policy, device, getattr(torch, config.model.dtype), plan_only)


def resolve_max_model_len(config: EngineConfig, args: ModelArgs) -> int:
    max_model_len = config.model.max_model_len or args.max_position_embeddings
    if max_model_len > args.max_position_embeddings:
        raise ConfigError("model.max_model_len", f"{max_model_len} exceeds the model's "
                          f"max_position_embeddings {args.max_position_embeddings}")
    return max_model_len


@attrs.frozen
class Parts:
    """An engine's working parts, built for one tensor-parallel rank."""

    model: Qwen35Model
    runner: ModelRunner
    scheduler: Scheduler
    strategy: object  # a bi_core.strategies.base.Strategy
    max_model_len: int
    checkpoint_has_mtp: bool


def build_parts(config: EngineConfig, registry: Registry, policy: Policy, factory: OpFactory, args: ModelArgs,
                index: CheckpointIndex | None, tp: TPInfo) -> Parts:
    """Model (weights loaded or randomly initialised), cache, model runner, scheduler, strategy."""
    device, dtype = factory.base["device"], factory.base["dtype"]
    max_model_len = resolve_max_model_len(config, args)
    has_mtp = index is not None and index.has_prefix("mtp.")
    strategy_cls = registry.strategies[config.strategy.name]
    with_mtp = builds_mtp_head(strategy_cls, args, index)
    try:
        model = Qwen35Model(args, factory, dtype, device, with_mtp=with_mtp, tp=tp)
    except torch.OutOfMemoryError:
        raise BiEngineError(f"the model's weights do not fit on {device} ({param_gib(args, dtype):.1f} GiB in "
                            f"{config.model.dtype}); use a larger GPU or fewer layers "
                            "(model.random.num_hidden_layers) for a quick run") from None
    if index is not None:
        load_weights(model, index)
    else:
        init_random_weights(model, config.model.random.seed)
    model.eval()
    model.lora_targets = _attach_lora(config, model, factory, tp)
    if config.strategy.draft_vocab_size is not None and model.mtp is not None:
        _prune_draft_vocab(config, model, factory, args, tp)
    lookahead, decode_tokens = strategy_cls.lookahead_for(config), strategy_cls.decode_tokens_for(config)
    chunk_size = resolve_chunk_size(config.scheduler, decode_tokens, config.cache.block_size)
    caching = prefix_caching(config, strategy_cls, chunk_size)
    cache = CacheManager(local_args(args, tp.world), config.cache, num_slots=config.scheduler.max_num_seqs,
                         max_model_len=max_model_len + lookahead, dtype=dtype, device=device, with_mtp=with_mtp,
                         state_ring=strategy_cls.state_ring_for(config),
                         num_snapshots=config.cache.prefix_snapshots if caching else 0)
    if caching:
        cache.prefix = PrefixCache(cache, grid=chunk_size, snapshot_slots=cache.snapshot_slots)
    capacity = cache.num_blocks * cache.block_size
    if capacity < max_model_len + lookahead:
        raise ConfigError("cache.num_blocks", f"the KV cache holds {capacity} tokens, fewer than one sequence of "
                          f"model.max_model_len={max_model_len}; raise cache.num_blocks or lower model.max_model_len")
    limits = [m.attn.decode_query_len for m in model.modules()
              if getattr(getattr(m, "attn", None), "decode_query_len", None)]
    exact_step_tokens = min(limits, default=None)
    strategy_cls.check(config, model, batch_invariant=policy.batch_invariant, exact_step_tokens=exact_step_tokens,
                       checkpoint_has_mtp=has_mtp)
    query_lens = strategy_cls.graph_query_lens(config)
    spec = GraphRunnerSpec(
        **factory.base, use_graphs=config.graph.enabled, capture=_capture(config, registry, factory),
        max_batch_size=config.graph.max_batch_size or config.scheduler.max_num_seqs,
        max_blocks_per_seq=cache.blocks_for(max_model_len + lookahead), scratch_page=cache.scratch_page,
        scratch_slot=cache.scratch_slot, state_ring=cache.state_ring, query_lens=query_lens,
        lora=bool(model.lora_targets), **mixed_fields(config, model, query_lens, chunk_size))
    runner = ModelRunner(model, cache, spec, with_mtp_graphs=strategy_cls.uses_mtp_head)
    if config.model.enable_return_routed_experts:
        if not args.is_moe:
            raise ConfigError("model.enable_return_routed_experts", "this model has no MoE layers (a dense Qwen3.5)")
        most = max(config.scheduler.max_num_batched_tokens, spec.max_batch_size * max(spec.query_lens))
        runner.record_routing(most)
    scheduler = Scheduler(config.scheduler, cache, chunk_size=chunk_size, exact_rebuild=policy.exact_preemption,
                          lookahead=lookahead, decode_tokens=decode_tokens, exact_step_tokens=exact_step_tokens,
                          eos_ids=args.eos_token_ids)
    return Parts(model, runner, scheduler, strategy_cls(config, runner), max_model_len, has_mtp)


def check_lora(config: EngineConfig, world: int) -> None:
    """LoRA with one rank only (the adapter stacks are not split over ranks)."""
    if config.lora.max_loras and world > 1:
        raise ConfigError("lora.max_loras", "LoRA adapters are not served with tensor parallelism yet "
                          "(parallel.tensor_parallel_size > 1); use replicas (serve --data-parallel-size)")


def _attach_lora(config: EngineConfig, model: Qwen35Model, factory: OpFactory, tp: TPInfo) -> dict:
    """The adapter stacks of ``lora.max_loras`` slots (none when 0: the model is as without LoRA)."""
    if not config.lora.max_loras:
        return {}
    check_lora(config, tp.world)
    from bi_core.lora.targets import attach

    return attach(model, factory, config.lora.max_loras, config.lora.max_rank, config.lora.experts)


def _capture(config: EngineConfig, registry: Registry, factory: OpFactory) -> bool:
    """``graph.capture`` resolved for the device and the backends that serve the model's ops."""
    backends = {c.backend for c in factory.choices.values() if c.backend in registry.backends}
    refusals = capture_refusals(registry.backends[name] for name in sorted(backends))
    return resolve_capture(config.graph, factory.base["device"], refusals)


def _prune_draft_vocab(config: EngineConfig, model: Qwen35Model, factory: OpFactory, args: ModelArgs,
                      tp: TPInfo) -> None:
    from bi_core.ops import LinearSpec
    from bi_core.strategies.draft_vocab import as_tensor, draft_table

    if tp.world > 1:
        raise ConfigError("strategy.draft_vocab_size", "not with parallel.tensor_parallel_size > 1 yet (each rank "
                          "holds a slice of the lm_head); leave it unset")
    table = draft_table(config.strategy.draft_vocab_size, args.vocab_size, args.eos_token_ids,
                        config.strategy.draft_vocab)
    head = factory.build("linear", LinearSpec(**factory.base, in_features=args.hidden_size, out_features=len(table)))
    model.set_draft_vocab(as_tensor(table, factory.base["device"]), head)


def prefix_caching(config: EngineConfig, strategy_cls, chunk: int) -> bool:
    """Whether prefix caching is on; raises when it was asked for where it cannot be exact."""
    wanted = config.cache.prefix_caching
    if config.model.enable_return_routed_experts:
        if wanted is True:
            raise ConfigError("cache.prefix_caching", "not with model.enable_return_routed_experts: a cached prefix's "
                              "tokens do not run through the router, so their routed experts would be missing; use "
                              "auto or false")
        return False
    if strategy_cls.is_speculative:
        if wanted is True:
            raise ConfigError("cache.prefix_caching", f"not with strategy {strategy_cls.name}: the MTP head's KV at a "
                              "page's last position depends on the token after the page, which a later request may "
                              "not share; use auto or false")
        return False
    if wanted is False:
        return False
    block = config.cache.block_size
    if chunk % block:
        if wanted is True:
            raise ConfigError("cache.prefix_caching", f"needs scheduler.prefill_chunk_size ({chunk}) to be a "
                              f"multiple of cache.block_size ({block}): cached prefixes end on chunk boundaries")
        return False
    return True


def param_gib(args: ModelArgs, dtype: torch.dtype) -> float:
    """Approximate weight size: embeddings, head, and every layer's projections and experts."""
    h = args.hidden_size
    per_layer = 4 * h * args.num_attention_heads * args.head_dim  # attention-sized projections
    if args.is_moe:
        per_layer += 3 * args.num_experts * h * args.moe_intermediate_size + 3 * h * args.shared_expert_intermediate_size
    else:
        per_layer += 3 * h * (args.intermediate_size or 0)
    heads = 1 if args.tie_word_embeddings else 2
    return (heads * args.vocab_size * h + args.num_hidden_layers * per_layer) * dtype.itemsize / 2**30


def explain(config: EngineConfig, registry: Registry | None = None) -> str:
    """Which builder serves each op and why the others were refused, without loading weights or
    building anything."""
    wanted = planned_device(config.model.device)
    live = wanted.type != "cuda" or torch.cuda.is_available()
    registry, _, factory = prepare(config, registry, live=live, plan_only=True)
    args, index = resolve_model(config)
    strategy_cls = registry.strategies[config.strategy.name]
    with_mtp = builds_mtp_head(strategy_cls, args, index)
    world = config.parallel.tensor_parallel_size
    check_tensor_parallel(args, world)
    model = Qwen35Model(args, factory, factory.base["dtype"], torch.device("meta"), with_mtp=with_mtp,
                        tp=TPInfo(0, world))
    targets = _attach_lora(config, model, factory, TPInfo(0, world))  # the lora op's choice, stacks on meta
    build_vision(config, factory, world, args, device=torch.device("meta"))  # the tower's ops, where there is one
    failures = factory.failures()
    text = factory.explain()
    if targets:
        from bi_core.lora.experts import ExpertTarget
        from bi_core.lora.targets import stack_bytes

        moe = sum(isinstance(t, ExpertTarget) for t in targets.values())
        text += (f"\nlora: {len(targets) - moe} projections" + (f" and {moe} MoE layers' experts" if moe else "")
                 + f" adapted, {stack_bytes(targets) / 2**30:.2f} GiB of adapter stacks "
                 f"({config.lora.max_loras} slots of rank {config.lora.max_rank}; the KV cache is sized after them)")
    try:  # how steps are launched: the runtime's choice from graph.* and the device, not an op's
        capture = _capture(config, registry, factory)
        text += "\n" + explain_line(GraphRunnerSpec(**factory.base, use_graphs=config.graph.enabled, capture=capture,
                                                   max_batch_size=config.scheduler.max_num_seqs))
    except ConfigError as e:
        failures.append(str(e))
    failure = "\n".join(dict.fromkeys(failures))
    if args.quantization is not None:
        from bi_core.quant.scheme import describe

        text += "\n" + describe(args.quantization)
    if wanted.type == "cuda":  # the GPUs its weights need, in the model dtype and in FP8
        from bi_core.quant.sizing import summary

        text += "\n" + summary(config, args, with_mtp, strategy_cls.state_ring_for(config))
    if not live:
        text = (f"note: {wanted} is not available on this machine: the plan is shown as selected for it, without "
                "the checks that need the device present (CUDA, SM90); package checks are this machine's\n" + text)
    return text + ("\n\nSELECTION FAILED:\n" + failure if failure else "")


