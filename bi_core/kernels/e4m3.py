"""Rounding float32 to float8_e4m3fn in float32 arithmetic, one copy for every kernel that
stores e4m3 values (the FP8 GEMMs' activation quantization, the norms' FP8 output copies, the FP8
KV cache's writes), and the per-token-group quantization built on it (``quant_group``): the cast
to float8 that follows is then exact, so the GPU and Triton's CPU interpreter (whose float32 ->
float8 cast is wrong: no ties-to-even, no carry into the exponent) store the same bits. Its own
module so that a kernel needing it depends on this file only (compile manifests hash a kernel's
imported files)."""

from __future__ import annotations

import triton
import triton.language as tl

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_EPS = 1e-10  # floor of a group's amax (vLLM's eps): an all-zero group gets a finite scale
GROUP = 128  # activation group width = weight block side (the checkpoints' [128, 128])
_FP8_MAX = tl.constexpr(FP8_MAX)  # the kernels' copies (a jitted function reads only constexpr globals)
_FP8_EPS = tl.constexpr(FP8_EPS)


@triton.jit
def round_e4m3(v):
    """``v`` (float32, |v| <= 448) rounded to the nearest float8_e4m3fn value, ties to even, sign
    kept (-0.0 stays -0.0), as a float32 holding that value exactly. Adding and subtracting
    1.5 * 2**(e + 20) (e: v's binade, floored at e4m3's smallest normal 2**-6) leaves a float32
    whose last place is e4m3's step 2**(e - 3) there, so float32's own rounding is e4m3's."""
    bits = v.to(tl.uint32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    e = tl.maximum((mag >> 23).to(tl.int32) - 127, -6)
    magic = (((e + 147) << 23) | 0x400000).to(tl.float32, bitcast=True)  # 1.5 * 2**(e + 20)
    r = (mag.to(tl.float32, bitcast=True) + magic) - magic
    return (r.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def quant_group(x):
    """One group of ``GROUP`` columns per row: ``x [R, GROUP]`` float32 (columns past K are 0) ->
    (values: float32 holding e4m3 values, scale [R]) with scale = max(amax, eps) / 448. The one
    copy of this arithmetic: the standalone quantizer, the GEMM's fused one and the norms' FP8
    copies must give the same bits."""
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.math.div_rn(tl.maximum(amax, _FP8_EPS), _FP8_MAX)
    q = tl.math.div_rn(x, scale[:, None])
    q = round_e4m3(tl.minimum(tl.maximum(q, -_FP8_MAX), _FP8_MAX))
    return q, scale
