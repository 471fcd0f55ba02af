"""A policy says what a mode demands of every op and which backend serves it."""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch

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
    "all_reduce": "every element summed in rank order, whatever the message size",
    "all_gather": "concatenation only (no arithmetic)",
}


@attrs.frozen(kw_only=True)
class Policy:
    """``preferences[op]`` is the backend order for that op; the first whose builder accepts wins.
    Without a per-op override (``policy.ops``) the order is the one backend ``backend``."""

    name: str
    batch_invariant: bool
    backend: str  # the config's backend, ``auto`` resolved for the mode and device
    preferences: Mapping[str, tuple[str, ...]]
    # a preempted sequence recomputes its generated tokens in decode arithmetic (not as prompt
    # chunks), so it resumes with the bits it had
    exact_preemption: bool

    def order(self, op: str) -> tuple[str, ...]:
        return self.preferences[op]

    def demand(self, op: str) -> str:
        return INVARIANT_DEMANDS[op] if self.batch_invariant else "fastest correct kernel"


INVARIANT_BACKEND = "cuda_hopper_invariant"
DEFAULT_CUDA_BACKEND = "cuda_default"
DEFAULT_OTHER_BACKEND = "reference"  # pure PyTorch: any device


def auto_backend(*, batch_invariant: bool, device: torch.device) -> str:
    """What ``backend: auto`` means: the one backend of the mode (``policy.batch_invariant``) on
    the device. Never a chain: an op that backend refuses fails with the selector's table; it is
    not handed silently to another backend (name one per op under ``policy.ops`` for that)."""
    if batch_invariant:
        return INVARIANT_BACKEND
    return DEFAULT_CUDA_BACKEND if device.type == "cuda" else DEFAULT_OTHER_BACKEND


def make_policy(
    *, batch_invariant: bool, backend: str, op_overrides: Mapping[str, tuple[str, ...]],
    device: torch.device | str | None = None,
) -> Policy:
    """Policy for a mode: ``backend`` is a name or ``auto`` (see :func:`auto_backend`). ``device``:
    the device the engine runs on, which ``auto`` needs in default mode; None: the one
    ``model.device: auto`` resolves to on this machine. Whether an explicit backend agrees with
    the mode is checked with the registry (``check_config``)."""
    if backend == "auto":
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        backend = auto_backend(batch_invariant=batch_invariant, device=torch.device(device))
    preferences = {op: tuple(op_overrides.get(op, (backend,))) for op in OP_NAMES}
    return Policy(
        name="batch_invariant" if batch_invariant else "default",
        batch_invariant=batch_invariant,
        backend=backend,
        preferences=preferences,
        exact_preemption=batch_invariant,
    )
