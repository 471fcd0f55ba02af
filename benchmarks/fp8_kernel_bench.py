"""Block-FP8 linear kernels at the 35B-A3B shape's dense GEMMs, one H200/H100 call: fp8_linear as
configured (activation quantization fused into the GEMM up to FUSE_QUANT_MAX_M rows), the same
with quantization as its own launch, quantize_act alone, and the bf16 Triton GEMM for comparison;
microseconds per call (CUDA graphs of 20 calls, so launch gaps do not count), and each one's weight
bytes over the copy bandwidth (the floor).

  python3 benchmarks/fp8_kernel_bench.py [M ...]   (default M = 1 8 64)
  python3 benchmarks/fp8_kernel_bench.py --sweep [M ...]

``--sweep``: the GEMM alone (activations quantized once, outside the timing) at each decode tile
(BLOCK_N, warps, stages; the same K order, so the same bits: checked against the tree's config)
and at other split counts (another K order: other bits, listed for the record), fastest first."""

from __future__ import annotations

import sys
from functools import partial

import torch

from bi_core.kernels.fp8 import fp8_config, fp8_linear, quantize_act
from bi_core.kernels.gemm import linear
from bi_core.quant.fp8 import quantize_blocks
from bi_core.tools.bench import measure_bandwidth

SHAPES = [(12352, 2048), (4096, 2048), (2048, 4096), (2048, 2048), (2048, 512)]  # (N, K)
REPS = 20


def timed_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * REPS)


def sweep(ms: list[int]) -> None:
    from bi_core.kernels.fp8 import fp8_gemm, split_k_for

    dev = torch.device("cuda")
    bw = measure_bandwidth(dev)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s; GEMM alone, us per call")
    for n, k in SHAPES[:3]:
        wq, ws = quantize_blocks(torch.randn(n, k, device=dev) * 0.02, (128, 128))
        split = split_k_for(n, k)
        for m in ms:
            xq, xs = quantize_act(torch.randn(m, k, device=dev, dtype=torch.bfloat16))
            base = fp8_config(m, n, k)
            ref = fp8_gemm(xq, xs, wq, ws, config=base)
            rows = []
            for bn in (16, 32, 64, 128):
                for warps in (4,):
                    for stages in (2, 3, 4):
                        for sp in sorted({split, split * 2}):
                            cfg = {**base, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages, "SPLIT_K": sp,
                                   "INLINE": False}
                            try:
                                out = fp8_gemm(xq, xs, wq, ws, config=cfg)
                                t = timed_us(partial(fp8_gemm, xq, xs, wq, ws, config=cfg))
                            except Exception as e:  # a tile that does not fit: reported, the sweep goes on
                                rows.append((float("inf"), cfg, type(e).__name__))
                                continue
                            same = torch.equal(out, ref)
                            if sp == split and not same:
                                raise SystemExit(f"{n}x{k} M={m} {cfg}: bits differ from the tree's config")
                            rows.append((t, cfg, "same bits" if same else "other K order"))
            rows.sort(key=lambda r: r[0])
            t_base = timed_us(partial(fp8_gemm, xq, xs, wq, ws, config=base))
            print(f"{n:>6} x {k:<5} M={m:<3} tree {t_base:6.1f}us (BLOCK_N {base['BLOCK_N']}, {base['num_warps']} warps, "
                  f"{base['num_stages']} stages, split {split}); floor {n * k / bw * 1e6:.1f}us; best:")
            for t, cfg, note in rows[:4]:
                print(f"      {t:6.1f}us  BLOCK_N {cfg['BLOCK_N']:>3} warps {cfg['num_warps']} stages "
                      f"{cfg['num_stages']} split {cfg['SPLIT_K']}  ({note})")


def main() -> None:
    if sys.argv[1:2] == ["--sweep"]:
        sweep([int(a) for a in sys.argv[2:]] or [1, 8, 64])
        return
    ms = [int(a) for a in sys.argv[1:]] or [1, 8, 64]
    dev = torch.device("cuda")
    bw = measure_bandwidth(dev)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s")
    print(f"{'N x K':>12} {'M':>4} {'fp8 (as set)':>13} {'fp8 2 launches':>15} {'quant':>7} {'bf16':>7} "
          f"{'fp8 floor':>9} {'bf16 floor':>10}  config")
    for n, k in SHAPES:
        w = torch.randn(n, k, device=dev) * 0.02
        wq, ws = quantize_blocks(w, (128, 128))
        wb = w.to(torch.bfloat16)
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            cfg = fp8_config(m, n, k)
            t_set = timed_us(partial(fp8_linear, x, wq, ws, config=cfg))
            t_two = timed_us(partial(fp8_linear, x, wq, ws, config={**cfg, "FUSE_QUANT": False}))
            t_q = timed_us(partial(quantize_act, x))
            t_b = timed_us(partial(linear, x, wb))
            print(f"{n:>6} x {k:<5} {m:>4} {t_set:>11.1f}us {t_two:>13.1f}us {t_q:>5.1f}us {t_b:>5.1f}us "
                  f"{n * k / bw * 1e6:>7.1f}us {2 * n * k / bw * 1e6:>8.1f}us  {cfg}")


if __name__ == "__main__":
    main()
