"""FP8 tests: the Triton kernels they compare the reference with run on the GPU when there is one,
else on the CPU through Triton's interpreter (as in tests/kernels)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated, i.e. first imported
