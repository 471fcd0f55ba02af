"""Config checks that run before anything is loaded: each raises one clear error."""

from __future__ import annotations

import torch

from bi_core.config import EngineConfig
from bi_core.errors import ConfigError, PolicyError
from bi_core.policies.base import INVARIANT_BACKEND, Policy
from bi_core.registry import Backend, Registry


def planned_device(spec: str) -> torch.device:
    """The device a config asks for, whether or not this machine has it (for explain)."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("model.device", f"{spec} requested but CUDA is not available on this machine")
    return device


def invariance_refusal(backend: Backend) -> str | None:
    """Why a backend can never serve batch-invariant mode, or None when it can (for some ops)."""
    if backend.invariance_refusal is not None:
        return backend.invariance_refusal
    if not any(b.is_batch_invariant for b in backend.builders):
        return "none of its builders is batch-invariant"
    return None


def check_backend_mode(backend: str, registry: Registry) -> None:
    """In batch-invariant mode an explicit ``backend`` must be able to serve it: the mode is set by
    ``policy.batch_invariant`` alone, and a backend that contradicts it is a config error, not a
    fallback. (A name not registered is left to the selector, whose table lists those that are.)"""
    if backend == "auto" or backend not in registry.backends:
        return
    reason = invariance_refusal(registry.backends[backend])
    if reason is None:
        return
    allowed = ", ".join(["auto", *sorted(n for n, b in registry.backends.items() if invariance_refusal(b) is None)])
    raise ConfigError("backend", f"{backend!r} contradicts batch-invariant mode (policy.batch_invariant: true): "
                                 f"{reason}. In batch-invariant mode backend is one of: {allowed} (auto, the default, "
                                 f"is {INVARIANT_BACKEND})")


def check_config(config: EngineConfig, policy: Policy, registry: Registry, device: torch.device, *,
                 live: bool = True) -> None:
    """Raise the first problem found; order: strategy, backends named, mode-specific refusals.
    ``live=False``: the device is not on this machine, so its compute capability is not checked."""
    strategy = config.strategy
    if strategy.name not in registry.strategies:
        raise ConfigError(
            "strategy.name", f"unknown strategy {strategy.name!r}; registered: {', '.join(sorted(registry.strategies))}"
        )
    if strategy.num_speculative_tokens is not None and not registry.strategies[strategy.name].is_speculative:
        raise ConfigError("strategy.num_speculative_tokens", f"only for speculative strategies, not {strategy.name!r}")
    for key in ("draft_vocab_size", "draft_vocab"):
        if getattr(strategy, key) is not None and not registry.strategies[strategy.name].is_speculative:
            raise ConfigError(f"strategy.{key}", f"only for speculative strategies, not {strategy.name!r}")
    if strategy.draft_vocab is not None and strategy.draft_vocab_size is None:
        raise ConfigError("strategy.draft_vocab", "set strategy.draft_vocab_size too (how many of its ids to use)")
    # cache.kv_cache_dtype fp8: the attention builders say whether they serve it (AttentionSpec's
    # kv_cache_dtype); its scale is fixed (1), never computed from a batch, so invariant mode takes it

    # expert parallelism: refused for good in invariant mode, not implemented (so refused, never ignored) in default
    if config.policy.expert_parallel_size > 1:
        if policy.batch_invariant:
            raise PolicyError("policy.expert_parallel_size: batch-invariant mode needs 1 (expert parallelism "
                              "moves a token's experts between GPUs depending on the batch)")
        raise ConfigError("policy.expert_parallel_size", "expert parallelism is not implemented yet; use 1")
    if config.policy.eplb:
        if policy.batch_invariant:
            raise PolicyError("policy.eplb: batch-invariant mode refuses EPLB (expert placement would change "
                              "with load, and with it the arithmetic of a row)")
        raise ConfigError("policy.eplb", "expert-parallel load balancing (EPLB) is not implemented yet; use false")
    if not policy.batch_invariant:
        return
    check_backend_mode(config.backend, registry)
    named = {name for op in policy.preferences for name in policy.order(op)}
    for name in sorted(named):
        if name in registry.backends:
            registry.backends[name].validate(policy)
    if device.type != "cuda":
        raise PolicyError(f"batch-invariant mode needs an SM90 (Hopper) GPU; model.device resolves to {device}")
    if not live:
        return
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        raise PolicyError(f"batch-invariant mode needs an SM90 (Hopper) GPU; {device} is SM{major}{minor} "
                          "(its kernels' reduction orders were validated on SM90 only)")
