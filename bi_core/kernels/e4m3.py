"""Rounding float32 to float8_e4m3fn in float32 arithmetic, one copy for every kernel that
stores e4m3 values (the FP8 GEMMs' activation quantization, the FP8 KV cache's writes): the cast
to float8 that follows is then exact, so the GPU and Triton's CPU interpreter (whose float32 ->
float8 cast is wrong: no ties-to-even, no carry into the exponent) store the same bits. Its own
module so that a kernel needing it depends on this file only (compile manifests hash a kernel's
imported files)."""

from __future__ import annotations

import triton
import triton.language as tl


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
