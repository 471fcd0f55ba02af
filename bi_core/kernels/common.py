"""Helpers shared by the kernels."""

from __future__ import annotations

import contextlib
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


try:  # programmatic dependent launch (SM90+): Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - an older Triton: PDL stays off
    gdc_launch_dependents = gdc_wait = None

PDL_MAX_TOKENS = 16  # CUDA graphs of up to this many tokens let each kernel's successor start early:
# it pays at small batch and costs at large (benchmarks section 25)
_pdl_supported: bool | None = None
_early = False


def _supported() -> bool:
    global _pdl_supported
    if _pdl_supported is None:
        _pdl_supported = (not INTERPRET and gdc_wait is not None and os.environ.get("BI_PDL", "1") != "0"
                          and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9)
    return _pdl_supported


@contextlib.contextmanager
def early_launch(on: bool):
    """Kernels launched inside ``early_launch(True)`` let the next kernel's programs be scheduled
    as soon as their own have started (``griddepcontrol.launch_dependents`` first thing); elsewhere
    the next kernel starts when they finish. Either way it waits in ``pdl_start`` for their
    completion and memory, so no result can change."""
    global _early
    before, _early = _early, on
    try:
        yield
    finally:
        _early = before


def pdl() -> dict:
    """Launch arguments of every kernel of ours: programmatic dependent launch (SM90+), eager or
    graphed, small step or large, so each kernel compiles once (``launch_pdl`` is a compile option:
    launching with and without it compiled every kernel twice, a third of a fresh start). Whether a
    kernel lets its successor start early is a runtime bool (bools get no value specialization):
    inside ``early_launch(True)`` only. ``BI_PDL=0`` turns PDL off everywhere (A/B runs)."""
    if _supported():
        return {"PDL": True, "launch_pdl": True, "pdl_early": _early}
    return {"PDL": False, "pdl_early": False}


@triton.jit
def pdl_start(PDL: tl.constexpr, early):
    """First statement of every kernel: wait until the previous grid has completed and its writes
    are visible; with ``early``, then let the next kernel's programs be scheduled."""
    if PDL:
        gdc_wait()
        if early:
            gdc_launch_dependents()
