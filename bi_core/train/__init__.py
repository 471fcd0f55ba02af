"""Training against the engine's own arithmetic: ``PolicyModel`` (a trainable Qwen3.5 whose
completion logprobs are bitwise the rollout's on the invariant backend), the parity gate, and
GRPO / PPO's loss."""

from __future__ import annotations

from bi_core.train.loss import LossStats, group_advantages, policy_loss
from bi_core.train.parity import OnPolicyMismatch, check_on_policy, max_gap, rollout_logprobs
from bi_core.train.policy import PolicyModel

__all__ = ["LossStats", "OnPolicyMismatch", "PolicyModel", "check_on_policy", "group_advantages", "max_gap",
           "policy_loss", "rollout_logprobs"]
