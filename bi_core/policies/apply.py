"""Applying a mode's process-wide settings, reversibly, around each engine call.

Invariant mode turns off TF32 and reduced-precision reductions for any torch matmul left in the
path, and refuses environments that would silently change the kernels (Triton's CPU interpreter
on a GPU run). Settings are restored after every call, so a default engine and an invariant
engine can live in one process (bench compares them side by side)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from bi_core.errors import PolicyError
from bi_core.policies.base import Policy


def _flags() -> dict:
    m = torch.backends.cuda.matmul
    return {
        "matmul.allow_tf32": m.allow_tf32,
        "matmul.bf16_reduced": m.allow_bf16_reduced_precision_reduction,
        "matmul.fp16_reduced": m.allow_fp16_reduced_precision_reduction,
        "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def _set(flags: dict) -> None:
    m = torch.backends.cuda.matmul
    m.allow_tf32 = flags["matmul.allow_tf32"]
    m.allow_bf16_reduced_precision_reduction = flags["matmul.bf16_reduced"]
    m.allow_fp16_reduced_precision_reduction = flags["matmul.fp16_reduced"]
    torch.backends.cudnn.allow_tf32 = flags["cudnn.allow_tf32"]
    torch.set_float32_matmul_precision(flags["float32_matmul_precision"])


INVARIANT_FLAGS = {
    "matmul.allow_tf32": False, "matmul.bf16_reduced": False, "matmul.fp16_reduced": False,
    "cudnn.allow_tf32": False, "float32_matmul_precision": "highest",
}


def check_environment(policy: Policy, device: torch.device) -> None:
    """Refuse settings that would change invariant kernels behind the engine's back."""
    if not policy.batch_invariant:
        return
    if device.type == "cuda" and os.environ.get("TRITON_INTERPRET") == "1":
        raise PolicyError("TRITON_INTERPRET=1 is set: Triton kernels would run in the CPU interpreter, "
                          "not the validated GPU kernels; unset it for batch-invariant mode")


@contextlib.contextmanager
def applied(policy: Policy) -> Iterator[None]:
    """Within the block, the mode's settings hold; afterwards the caller's are back."""
    if not policy.batch_invariant:
        yield
        return
    saved = _flags()
    _set(INVARIANT_FLAGS)
    try:
        yield
    finally:
        _set(saved)
