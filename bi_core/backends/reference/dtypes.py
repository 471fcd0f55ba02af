"""Checks shared by the reference builders."""

from __future__ import annotations

import torch

from bi_core.ops.base import OpSpec

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


def check_dtype(spec: OpSpec) -> list[str]:
    return [] if spec.dtype in SUPPORTED_DTYPES else [f"dtype {spec.dtype} not supported (float32, bfloat16)"]
