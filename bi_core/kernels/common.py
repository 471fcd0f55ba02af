"""Helpers shared by the kernels."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Triton's CPU interpreter computes bf16 dots wrongly (fp32 ones exactly): there, dots upcast.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DOT_NATIVE, DOT_IEEE, DOT_UPCAST = 0, 1, 2


def dot_mode(dtype: torch.dtype) -> int:
    if INTERPRET:
        return DOT_UPCAST
    return DOT_IEEE if dtype == torch.float32 else DOT_NATIVE


@triton.jit
def mma(a, b, acc, MODE: tl.constexpr):
    """``acc + a @ b``: native tensor-core dot for bf16, IEEE fp32 (no TF32) for fp32."""
    if MODE == 2:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    elif MODE == 1:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)
