"""Policies: what the default and batch-invariant modes demand of every op."""

from bi_core.policies.base import INVARIANT_DEMANDS, Policy, make_policy
from bi_core.policies.checks import check_config, planned_device, resolve_device

__all__ = ["INVARIANT_DEMANDS", "Policy", "check_config", "make_policy", "planned_device", "resolve_device"]
