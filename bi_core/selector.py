"""Selects one builder per op spec by walking the policy's order; refusals are collected, and
when nothing fits the error carries the whole table. ``explain`` prints the same table."""

from __future__ import annotations

import attrs
import torch

from bi_core.errors import BackendSelectionError, BiEngineError, PluginError
from bi_core.ops.base import OpSpec
from bi_core.plugins import BUILTIN_PLUGINS, plugin_label
from bi_core.policies.base import Policy
from bi_core.registry import Registry


@attrs.frozen
class Choice:
    op: str
    spec: OpSpec
    backend: str | None
    refusals: tuple[tuple[str, tuple[str, ...]], ...]  # (backend, reasons) tried before / instead


def refusal_reasons(registry: Registry, policy: Policy, op: str, spec: OpSpec, name: str) -> list[str]:
    backend = registry.backends.get(name)
    if backend is None:
        known = ", ".join(sorted(registry.backends)) or "none"
        return [f"backend not registered (registered: {known})"]
    builder = backend.builder(op)
    if builder is None:
        return [f"has no builder for op '{op}'"]
    reasons = _call_builder(registry, name, builder, "check", spec, policy)
    if not isinstance(reasons, (list, tuple)) or not all(isinstance(r, str) for r in reasons):
        raise PluginError(f"{_builder_label(registry, name, builder, 'check')} returned {reasons!r}; check must "
                          "return a list of reason strings (empty: it can serve the spec)")
    reasons = list(reasons)
    if policy.batch_invariant and not builder.is_batch_invariant:
        reasons.append("builder is not batch-invariant")
    return reasons


def _builder_label(registry: Registry, backend: str, builder: object, method: str) -> str:
    owner = registry.owners.get(backend)
    where = plugin_label(registry, owner) if owner is not None else "a plugin"
    return f"{where}, backend '{backend}', {type(builder).__name__}.{method}"


def _call_builder(registry: Registry, backend: str, builder: object, method: str, *args: object) -> object:
    """A builder's ``check`` or ``build``. What a third-party plugin's builder raises is the plugin's,
    and the error says so (the plugin, the backend, the builder and the method) in one line instead
    of a bare traceback. A built-in's exception is our bug and keeps its traceback; our own errors
    and running out of device memory (which the engine build reports) pass as they are."""
    try:
        return getattr(builder, method)(*args)
    except (BiEngineError, torch.OutOfMemoryError):
        raise
    except Exception as e:  # noqa: BLE001 (whatever third-party code raises is the plugin's)
        if registry.owners.get(backend) in BUILTIN_PLUGINS:
            raise
        raise PluginError(f"{_builder_label(registry, backend, builder, method)} raised "
                          f"{type(e).__name__}: {e}") from e


def choose(registry: Registry, policy: Policy, op: str, spec: OpSpec) -> Choice:
    refusals = []
    for name in policy.order(op):
        reasons = refusal_reasons(registry, policy, op, spec, name)
        if not reasons:
            return Choice(op, spec, name, tuple(refusals))
        refusals.append((name, tuple(reasons)))
    return Choice(op, spec, None, tuple(refusals))


@attrs.frozen
class Planned:
    """What a plan-only factory returns instead of an impl (``explain`` builds nothing)."""

    op: str
    backend: str


class OpFactory:
    """Builds impls for the model; memoises by (op, spec) and remembers every choice. With
    ``plan_only`` it selects but builds nothing (no device memory, no kernel compiles)."""

    def __init__(self, registry: Registry, policy: Policy, device: torch.device, dtype: torch.dtype,
                 plan_only: bool = False) -> None:
        self.registry = registry
        self.policy = policy
        self.plan_only = plan_only
        self.base = {"device": device, "dtype": dtype}  # every spec's common fields
        self.choices: dict[tuple[str, OpSpec], Choice] = {}
        self._impls: dict[tuple[str, OpSpec], object] = {}

    def build(self, op: str, spec: OpSpec) -> object:
        key = (op, spec)
        if key not in self._impls:
            choice = choose(self.registry, self.policy, op, spec)
            self.choices[key] = choice
            if choice.backend is None and self.plan_only:  # explain: record it and go on to the other ops
                self._impls[key] = Planned(op, "NONE")
                return self._impls[key]
            if choice.backend is None:
                raise BackendSelectionError(op, [(b, list(r)) for b, r in choice.refusals])
            builder = self.registry.backends[choice.backend].builder(op)
            self._impls[key] = Planned(op, choice.backend) if self.plan_only else \
                _call_builder(self.registry, choice.backend, builder, "build", spec)
        return self._impls[key]

    def failures(self) -> list[str]:
        """The selection errors of ops no backend could serve (a plan-only factory records them)."""
        return [str(BackendSelectionError(c.op, [(b, list(r)) for b, r in c.refusals]))
                for c in self.choices.values() if c.backend is None]

    def explain(self) -> str:
        lines = [f"policy: {self.policy.name}"]
        seen_ops: dict[str, list[Choice]] = {}
        for (op, _), choice in self.choices.items():
            seen_ops.setdefault(op, []).append(choice)
        for op, choices in seen_ops.items():
            backends = sorted({c.backend or "NONE" for c in choices})
            lines.append(f"{op:<13} -> {', '.join(backends)}   ({len(choices)} spec(s); demand: {self.policy.demand(op)})")
            refused = {}
            for c in choices:
                for name, reasons in c.refusals:
                    refused.setdefault(name, set()).update(reasons)
            for name, reasons in refused.items():
                lines.append(f"{'':<16}refused {name}: {'; '.join(sorted(reasons))}")
        return "\n".join(lines)
