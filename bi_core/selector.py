"""Selects one builder per op spec by walking the policy's order; refusals are collected, and
when nothing fits the error carries the whole table. ``explain`` prints the same table."""

from __future__ import annotations

import attrs
import torch

from bi_core.errors import BackendSelectionError
from bi_core.ops.base import OpSpec
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
    reasons = list(builder.check(spec, policy))
    if policy.batch_invariant and not builder.is_batch_invariant:
        reasons.append("builder is not batch-invariant")
    return reasons


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
            self._impls[key] = Planned(op, choice.backend) if self.plan_only else builder.build(spec)
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
