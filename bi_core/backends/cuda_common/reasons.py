"""Reasons shared by the CUDA builders."""

from __future__ import annotations

import torch

from bi_core.ops.base import OpSpec, require_hopper, require_module


def cuda_reasons(spec: OpSpec, *, dtypes=(torch.bfloat16,), hopper: bool = False,
                 modules: tuple[str, ...] = ("triton",)) -> list[str]:
    reasons: list[str] = []
    if spec.device.type != "cuda":
        reasons.append(f"needs a CUDA device, spec is on {spec.device}")
    elif hopper:
        reasons += require_hopper(spec)
    if spec.dtype not in dtypes:
        reasons.append(f"dtype {spec.dtype} not supported ({', '.join(str(d) for d in dtypes)})")
    for m in modules:
        reasons += require_module(m)
    return reasons
