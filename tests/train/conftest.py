"""Training tests run the engine's kernels on the GPU when there is one, else on the CPU through
Triton's interpreter (as tests/kernels do)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, i.e. first imported

pytest.importorskip("triton")

from interp_dot import device, ordered_dot  # noqa: E402,F401 (fixtures; after the interpreter is chosen)
