"""Kernel tests run on the GPU when there is one, else on the CPU through Triton's interpreter."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, i.e. first imported

pytest.importorskip("triton")


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _dot_in_k_order(self, a, b, acc, input_precision, max_num_imprecise_acc):
    """``acc + a @ b`` with every output element summed over K in ascending order (fp32, products
    rounded once), whatever its row or column in the tile and the tile's shape."""
    from triton.runtime.interpreter import TensorHandle

    assert a.data.dtype == b.data.dtype == np.float32, "kernels/common.py upcasts dots in the interpreter"
    products = a.data[..., :, :, None] * b.data[..., None, :, :]  # [..., M, K, N]
    total = np.cumsum(products, axis=-2)[..., -1, :]  # cumsum: a sequential sum, by definition
    return TensorHandle((total + acc.data).astype(acc.data.dtype), acc.dtype.scalar)


@pytest.fixture
def ordered_dot(monkeypatch):
    """Under the interpreter, ``tl.dot`` with one fixed order per output element.

    The interpreter's dot is numpy's matmul (OpenBLAS), whose micro-kernels round an element by
    its place in the matrix: measured here (AMD EPYC, numpy 2.2's OpenBLAS 0.3.29, Haswell
    kernels), row j of ``[16, 64] @ [64, 32]`` differs from the same row computed as row 0 for
    j = 6..15, also for bf16-valued inputs (so not only FMA vs multiply-add), and columns 0..15
    differ from ``[16, 64] @ [64, 16]``'s. A test comparing a row alone (row 0 of its tile) with
    the row inside a batch (row 6 of a tile) would see numpy. Whether a GPU dot gives an element
    the same bits anywhere in a tile is the hardware's side, measured and checked on the GPU
    (kernels/gemm.py, tests/gpu); with this dot an interpreter test sees only the
    kernel's own arithmetic: which K steps, splits, chunks and slots make a row's result, and in
    which order they are added. On the GPU this fixture does nothing."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        from triton.runtime.interpreter import InterpreterBuilder

        monkeypatch.setattr(InterpreterBuilder, "create_dot", _dot_in_k_order)


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
