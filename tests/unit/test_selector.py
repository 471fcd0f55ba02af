"""The selector walks the policy's order per op, records every refusal, never falls back silently."""

from __future__ import annotations

import pytest
import torch

from bi_core.errors import BackendSelectionError
from bi_core.ops.base import OpBuilder
from bi_core.ops.norm import NormSpec
from bi_core.plugins import load_registry
from bi_core.policies import make_policy
from bi_core.registry import Backend
from bi_core.selector import OpFactory

SPEC = NormSpec(dtype=torch.float32, device=torch.device("cpu"), hidden_size=8, eps=1e-6)


class Refusing(OpBuilder):
    op = "norm"

    def check(self, spec, policy):
        return ["needs a rainbow"]

    def build(self, spec):
        raise AssertionError


class Invariant(OpBuilder):
    op = "norm"
    is_batch_invariant = True

    def build(self, spec):
        return "invariant-impl"


def registry():
    reg = load_registry(load_entry_points=False)
    reg.add_backend(Backend(name="refusing", builders=(Refusing(),)), "test")
    reg.add_backend(Backend(name="invariant", builders=(Invariant(),)), "test")
    return reg


def factory(batch_invariant, order):
    policy = make_policy(batch_invariant=batch_invariant, backend="reference", op_overrides={"norm": order})
    return OpFactory(registry(), policy, torch.device("cpu"), torch.float32)


def test_walks_order_and_records_refusals():
    f = factory(False, ("refusing", "reference"))
    impl = f.build("norm", SPEC)
    assert type(impl).__name__ == "ReferenceRMSNormImpl"
    text = f.explain()
    assert "norm          -> reference" in text and "refused refusing: needs a rainbow" in text


def test_invariant_mode_refuses_non_invariant_builders():
    f = factory(True, ("reference", "invariant"))
    assert f.build("norm", SPEC) == "invariant-impl"
    assert "refused reference: builder is not batch-invariant" in f.explain()


def test_failure_lists_every_candidate():
    f = factory(True, ("refusing", "reference", "ghost"))
    with pytest.raises(BackendSelectionError) as e:
        f.build("norm", SPEC)
    msg = str(e.value)
    assert "refusing: needs a rainbow; builder is not batch-invariant" in msg
    assert "reference: builder is not batch-invariant" in msg
    assert "ghost: backend not registered" in msg


def test_memoised_per_spec():
    f = factory(False, ("reference",))
    assert f.build("norm", SPEC) is f.build("norm", SPEC)
