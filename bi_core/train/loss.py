"""GRPO / PPO's clipped policy loss over completion tokens. With the trainer's logprobs bitwise the
rollout's, every ratio at the first step is exactly 1 (``exp(0)``): no importance correction."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch


@attrs.frozen
class LossStats:
    num_tokens: int
    max_ratio_gap: float  # max |ratio - 1| (0.0 when on-policy)
    clip_fraction: float


def group_advantages(rewards: Sequence[float], group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's advantage of each sample: its reward minus its group's mean, over the group's std
    (groups of ``group_size`` consecutive samples, the n samples of one prompt)."""
    r = torch.as_tensor(rewards, dtype=torch.float32)
    if r.numel() % group_size:
        raise ValueError(f"{r.numel()} rewards do not split into groups of {group_size}")
    g = r.view(-1, group_size)
    return ((g - g.mean(dim=1, keepdim=True)) / (g.std(dim=1, keepdim=True, unbiased=False) + eps)).flatten()


def policy_loss(logprobs: Sequence[torch.Tensor], old_logprobs: Sequence, advantages: torch.Tensor, *,
                clip_low: float = 0.2, clip_high: float = 0.2) -> tuple[torch.Tensor, LossStats]:
    """``-mean_t min(ratio_t A, clip(ratio_t, 1 - clip_low, 1 + clip_high) A)`` over every completion
    token of every sequence (token-mean, as DAPO and most GRPO trainers), ``ratio_t = exp(logp_t -
    old_t)``; ``advantages [B]`` per sequence. ``old_logprobs``: the rollout's (lists or tensors)."""
    new = torch.cat([lp.float() for lp in logprobs])
    old = torch.cat([torch.as_tensor(o, dtype=torch.float32, device=new.device) for o in old_logprobs])
    adv = torch.cat([a.expand(len(lp)) for a, lp in zip(advantages.to(new.device).float(), logprobs)])
    ratio = torch.exp(new - old)
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = -torch.minimum(ratio * adv, clipped * adv).mean()
    with torch.no_grad():
        stats = LossStats(int(new.numel()), float((ratio - 1).abs().max()), float((ratio != clipped).float().mean()))
    return loss, stats
