"""What programmatic dependent launch (PDL) saves per kernel boundary inside a CUDA graph.

A chain of dependent Triton kernels (each reads what the previous one wrote) is captured in one
graph and replayed, launched normally or with PDL (each kernel waits on the previous grid with
``gdc_wait`` before touching memory, then lets the next one launch). Two kernel sizes: one tiny
program, and 264 programs streaming 8 MB (a decode GEMV's shape). Prints us per kernel and checks
the chain's result (a race would show as a wrong sum).

python3 benchmarks/pdl_probe.py"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _step(X, Y, W, w_per_prog, BLOCK: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), tl.float32)
    if EARLY:  # the weights do not depend on the previous kernel: stream them before the wait
        for i in range(0, w_per_prog, BLOCK):
            acc += tl.load(W + pid * w_per_prog + i + offs).to(tl.float32)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if not EARLY:
        for i in range(0, w_per_prog, BLOCK):
            acc += tl.load(W + pid * w_per_prog + i + offs).to(tl.float32)
    x = tl.load(X + pid * BLOCK + offs)
    tl.store(Y + pid * BLOCK + offs, x + 1.0 + tl.sum(acc, axis=0) * 0.0)


def chain_us(programs: int, w_bytes: int, pdl: bool, early: bool, length: int = 400) -> float:
    block = 1024
    x = torch.zeros(programs * block, device="cuda")
    y = torch.zeros_like(x)
    w_per_prog = max(block, w_bytes // 2 // programs // block * block)
    w = torch.ones(programs * w_per_prog, device="cuda", dtype=torch.bfloat16)

    def run():
        a, b = x, y
        for _ in range(length):
            _step[(programs,)](a, b, w, w_per_prog, BLOCK=block, PDL=pdl, EARLY=early, num_warps=4,
                               launch_pdl=pdl)
            a, b = b, a

    run()
    torch.cuda.synchronize()
    x.zero_()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    g.replay()
    torch.cuda.synchronize()
    ok = bool((x == length).all()) if length % 2 == 0 else bool((y == length).all())
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1e3 / 20 / length
    print(f"programs={programs:<4} weights={w_bytes >> 20:>2} MB pdl={pdl!s:<5} early={early!s:<5} "
          f"{us:6.2f} us/kernel  result ok={ok}", flush=True)
    return us


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    for programs, w_bytes in ((1, 0), (264, 8 << 20)):
        for pdl, early in ((False, False), (True, False), (True, True)):
            if early and not w_bytes:
                continue
            chain_us(programs, w_bytes, pdl, early)


if __name__ == "__main__":
    main()
