"""A policy says what a mode demands of every op and in which order backends are tried."""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from bi_core.config import OP_NAMES

# What invariant mode demands of each op (printed by `bi-engine explain`).
INVARIANT_DEMANDS: Mapping[str, str] = {
    "attention": "a query row's KV traversal and reduction order depend only on that row",
    "linear": "a row's K reduction order is fixed by (N, K), never by the number of rows",
    "norm": "one row per program, fixed block, fp32 accumulation",
    "topk": "row-wise softmax/top-k, ties to the lower expert id",
    "moe": "a row's result does not depend on how many rows an expert gets; fp32 combine in slot order",
    "gdn": "per-sequence kernels with pinned configs; decode/verify use the recurrent form",
    "sampling": "randomness keyed by (request seed, position) only",
    "graph_runner": "padding rows of a bucket never change a real row",
    "all_reduce": "every element summed in rank order, whatever the message size",
    "all_gather": "concatenation only (no arithmetic)",
}


@attrs.frozen(kw_only=True)
class Policy:
    """``preferences[op]`` is the backend order for that op; the first whose builder accepts wins."""

    name: str
    batch_invariant: bool
    preferences: Mapping[str, tuple[str, ...]]
    # a preempted sequence recomputes its generated tokens in decode arithmetic (not as prompt
    # chunks), so it resumes with the bits it had
    exact_preemption: bool

    def order(self, op: str) -> tuple[str, ...]:
        return self.preferences[op]

    def demand(self, op: str) -> str:
        return INVARIANT_DEMANDS[op] if self.batch_invariant else "fastest correct kernel"


DEFAULT_ORDER = ("cuda_default", "reference")
INVARIANT_ORDER = ("cuda_hopper_invariant",)


def make_policy(
    *, batch_invariant: bool, backend: str, op_overrides: Mapping[str, tuple[str, ...]]
) -> Policy:
    """Policy for a mode: ``backend`` is a name or ``auto`` (the mode's own order)."""
    if backend == "auto":
        base = INVARIANT_ORDER if batch_invariant else DEFAULT_ORDER
    else:
        base = (backend,)
    preferences = {op: tuple(op_overrides.get(op, base)) for op in OP_NAMES}
    return Policy(
        name="batch_invariant" if batch_invariant else "default",
        batch_invariant=batch_invariant,
        preferences=preferences,
        exact_preemption=batch_invariant,
    )
