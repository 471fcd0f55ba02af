"""What plugins register: backends (a name and one builder per op they serve) and strategies."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from bi_core.config import OP_NAMES, RETIRED_OPS
from bi_core.errors import BatchInvarianceUnsupported, PluginError
from bi_core.ops.base import OpBuilder

if TYPE_CHECKING:
    from bi_core.policies.base import Policy
    from bi_core.strategies.base import Strategy


@attrs.frozen(kw_only=True)
class Backend:
    """A named set of op builders. A backend may serve only some ops (the policy picks per op).

    ``invariance_refusal``: set when the whole backend can never be batch-invariant; asking it
    for invariance then raises :class:`BatchInvarianceUnsupported` with this reason.
    ``compile_manifests``: the folder of Triton compiles recorded from this backend's starts,
    compiled ahead by the next start of the same shape (``bi_core/runtime/compile_ahead.py``).
    ``graph_capture_refusal``: set when its impls cannot run inside a captured CUDA graph (they
    read the step's host lists, which a replay would not update); graph steps over them then run
    only in the rerun mode (``graph.capture: false``, ``bi_core/runtime/graphs/mode.py``).
    """

    name: str
    builders: tuple[OpBuilder, ...]
    description: str = ""
    invariance_refusal: str | None = None
    compile_manifests: Path | None = None
    graph_capture_refusal: str | None = None

    def __attrs_post_init__(self) -> None:
        ops = [b.op for b in self.builders]
        for op in ops:
            if op in RETIRED_OPS:
                raise PluginError(f"backend '{self.name}': builder for op '{op}', which is {RETIRED_OPS[op]}")
            if op not in OP_NAMES:
                raise PluginError(f"backend '{self.name}': builder for unknown op '{op}'")
        if len(set(ops)) != len(ops):
            raise PluginError(f"backend '{self.name}': more than one builder for an op ({ops})")

    def builder(self, op: str) -> OpBuilder | None:
        return next((b for b in self.builders if b.op == op), None)

    def validate(self, policy: Policy) -> None:
        if policy.batch_invariant and self.invariance_refusal is not None:
            raise BatchInvarianceUnsupported(self.name, self.invariance_refusal)


@attrs.define
class PluginInfo:
    name: str
    distribution: str
    version: str
    is_builtin: bool


@attrs.define
class Registry:
    backends: dict[str, Backend] = attrs.field(factory=dict)
    strategies: dict[str, type[Strategy]] = attrs.field(factory=dict)
    plugins: list[PluginInfo] = attrs.field(factory=list)
    owners: dict[str, str] = attrs.field(factory=dict)  # backend/strategy name -> plugin name

    def add_backend(self, backend: Backend, owner: str) -> None:
        if backend.name in self.backends:
            raise PluginError(
                f"backend '{backend.name}' registered twice (by {self.owners[backend.name]} and {owner})"
            )
        self.backends[backend.name] = backend
        self.owners[backend.name] = owner

    def add_strategy(self, strategy: type[Strategy], owner: str) -> None:
        name = strategy.name
        if name in self.strategies:
            raise PluginError(f"strategy '{name}' registered twice (by {self.owners['s:' + name]} and {owner})")
        self.strategies[name] = strategy
        self.owners["s:" + name] = owner
