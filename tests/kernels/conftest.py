"""Kernel tests run on the GPU when there is one, else on the CPU through Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, i.e. first imported

pytest.importorskip("triton")

from interp_dot import device, ordered_dot  # noqa: E402,F401 (fixtures; after the interpreter is chosen)


@pytest.fixture
def poisoned_empty():
    """``torch.empty`` and friends return NaN (integers: their maximum) for the test's duration,
    so any element a kernel fails to write, or reads before it is written, shows."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=True)  # fills fresh memory (fill_uninitialized_memory)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
