"""The fail-closed parity gate: training stops at the first completion token whose trainer logprob
is not, bitwise, the one the rollout reported."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bi_core.errors import BiEngineError


class OnPolicyMismatch(BiEngineError):
    """A trainer logprob differs from the rollout's (``check_on_policy``)."""


def rollout_logprobs(rollout) -> list[list[float]]:
    """Per sequence, its sampled logprobs: from RequestOutputs (every sample of an n > 1 request,
    in order) or from lists of floats."""
    out: list[list[float]] = []
    for r in rollout:
        if hasattr(r, "outputs"):
            out += [list(o.token_logprobs) for o in r.outputs]
        else:
            out.append([float(x) for x in r])
    return out


def _bits(values) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.float32).detach().cpu().reshape(-1).view(torch.int32)


def check_on_policy(rollout, train_logprobs: Sequence[torch.Tensor]) -> None:
    """Raise ``OnPolicyMismatch`` naming the first differing token (sequence, position, both
    values and their bits) unless every trainer logprob equals the rollout's bitwise. ``rollout``:
    the engine's RequestOutputs, or per sequence its logprobs."""
    want = rollout_logprobs(rollout)
    if len(want) != len(train_logprobs):
        raise OnPolicyMismatch(f"the rollout has {len(want)} sequences, the trainer computed {len(train_logprobs)}")
    bad, total, first = 0, 0, None
    for i, (w, t) in enumerate(zip(want, train_logprobs)):
        a, b = _bits(w), _bits(t)
        if a.shape != b.shape:
            raise OnPolicyMismatch(f"sequence {i}: the rollout has {a.numel()} tokens, the trainer {b.numel()}")
        diff = (a != b).nonzero().flatten()
        total += a.numel()
        bad += diff.numel()
        if first is None and diff.numel():
            j = int(diff[0])
            first = (i, j, a[j].view(torch.float32).item(), b[j].view(torch.float32).item(), int(a[j]), int(b[j]))
    if first is not None:
        i, j, x, y, bx, by = first
        raise OnPolicyMismatch(f"{bad} of {total} completion tokens differ from the rollout; the first: sequence {i}, "
                               f"token {j}: rollout logprob {x!r} (0x{bx & 0xFFFFFFFF:08x}), trainer {y!r} "
                               f"(0x{by & 0xFFFFFFFF:08x})")


def max_gap(rollout, train_logprobs: Sequence[torch.Tensor]) -> float:
    """``max |train - rollout|`` over every completion token (0.0 when on-policy)."""
    want = rollout_logprobs(rollout)
    gaps = [(torch.as_tensor(w, dtype=torch.float64) - t.detach().double().cpu()).abs().max().item()
            for w, t in zip(want, train_logprobs) if len(w)]
    return max(gaps, default=0.0)
