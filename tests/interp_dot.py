"""Fixtures of tests that run Triton kernels on the CPU through Triton's interpreter (or on the GPU):
``device``, and ``ordered_dot``, the interpreter's dot with one fixed summation order per output
element. The conftest that imports them sets ``TRITON_INTERPRET`` first."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch


def dot_in_k_order(self, a, b, acc, input_precision, max_num_imprecise_acc):
    """``acc + a @ b`` with every output element summed over K in ascending order (fp32, products
    rounded once), whatever its row or column in the tile and the tile's shape."""
    from triton.runtime.interpreter import TensorHandle

    assert a.data.dtype == b.data.dtype == np.float32, "kernels/common.py upcasts dots in the interpreter"
    products = a.data[..., :, :, None] * b.data[..., None, :, :]  # [..., M, K, N]
    total = np.cumsum(products, axis=-2)[..., -1, :]  # cumsum: a sequential sum, by definition
    return TensorHandle((total + acc.data).astype(acc.data.dtype), acc.dtype.scalar)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


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

        monkeypatch.setattr(InterpreterBuilder, "create_dot", dot_in_k_order)
