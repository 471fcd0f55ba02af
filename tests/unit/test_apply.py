"""Invariant-mode settings are applied around engine calls and restored afterwards."""

from __future__ import annotations

import pytest
import torch

from bi_core.errors import PolicyError
from bi_core.policies import make_policy
from bi_core.policies.apply import applied, check_environment


def test_applied_is_reversible():
    inv = make_policy(batch_invariant=True, backend="auto", op_overrides={})
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    with applied(inv):
        assert not torch.backends.cuda.matmul.allow_tf32
        assert not torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    default = make_policy(batch_invariant=False, backend="auto", op_overrides={})
    with applied(default):
        assert torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False


def test_interpreter_refused_on_gpu(monkeypatch):
    inv = make_policy(batch_invariant=True, backend="auto", op_overrides={})
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(PolicyError, match="TRITON_INTERPRET=1 is set"):
        check_environment(inv, torch.device("cuda"))
    check_environment(inv, torch.device("cpu"))
