"""FlashInfer's block-FP8 GEMM for Hopper (``fp8_blockscale_gemm_sm90``: DeepGEMM-style kernels,
swapped A/B under 32 rows) against bi-engine's Triton ``fp8_linear``, at the 35B-A3B shape's dense
GEMMs: the candidate for ``cuda_default``'s FP8 linear (issue 25). One device call:

  python3 dev/probes/fi_fp8_gemm.py --build   (compile FlashInfer's module only: run it in the
                                              background, e.g. gpu_run.sh's bg: step)
  python3 dev/probes/fi_fp8_gemm.py [M ...]   (default M = 1 8 64)

Per shape and M: microseconds per call (CUDA graphs of 20 calls, as fp8_kernel_bench.py) for
fp8_linear (bf16 rows in: quantize + GEMM), FlashInfer with bf16 rows in (it quantizes per token
group itself) and FlashInfer on rows we quantized (FP8 in, our scales); each output's max |error|
against the dequantized float32 product, relative to that product's max, and whether FlashInfer's
rows depend on M (row 0 alone against row 0 in the batch: a default backend may differ, the
invariant one may not)."""

from __future__ import annotations

import sys
import time
from functools import partial

import torch

SHAPES = [(12352, 2048), (4096, 2048), (2048, 4096), (2048, 2048), (2048, 512)]  # (N, K), as fp8_kernel_bench


def runner():
    from flashinfer.gemm.gemm_base import get_fp8_blockscale_gemm_runner_sm90

    start = time.perf_counter()
    get_fp8_blockscale_gemm_runner_sm90()
    print(f"FlashInfer fp8_blockscale_gemm_90 ready in {time.perf_counter() - start:.1f} s", flush=True)


SWEEP_M = [*range(1, 41), 48, 56, 63, 64, 65, 96, 128, 192, 255, 256, 384, 512, 768, 1000, 1024]


def invariance(fi_gemm, n: int, k: int, wq, ws, dev) -> None:
    """Rows of FlashInfer's GEMM at every M of SWEEP_M (a prefix of one 1024-row pool) and under a
    row permutation, against the same rows in the 1024-row call. Two negative controls: our FP8
    GEMM with a split count that follows M (2 ranges up to 64 rows, 1 beyond: it must differ,
    or the comparison has no teeth), and cuBLAS's bf16 GEMM on the dequantized weight (whose rows
    were invariant at 4 of 5 shapes on an H200: it proves little alone)."""
    from bi_core.kernels.fp8 import fp8_config, fp8_gemm, quantize_act
    from bi_core.quant.fp8_numerics import dequantize_blocks

    pool = torch.randn(1024, k, device=dev, dtype=torch.bfloat16)
    xq, xs = quantize_act(pool)
    full = fi_gemm(xq, xs)
    bad = [m for m in SWEEP_M if not torch.equal(fi_gemm(xq[:m].contiguous(), xs[:m].contiguous()), full[:m])]
    perm = torch.randperm(1024, device=dev)
    permuted = torch.equal(fi_gemm(xq[perm].contiguous(), xs[perm].contiguous()), full[perm])
    wb = dequantize_blocks(wq, ws, (128, 128)).to(torch.bfloat16)
    full_mm = pool @ wb.t()
    control = [m for m in SWEEP_M if not torch.equal(pool[:m] @ wb.t(), full_mm[:m])]
    follows_m = lambda a, s: fp8_gemm(a, s, wq, ws, torch.bfloat16,
                                      config={**fp8_config(a.shape[0], n, k), "SPLIT_K": 2 if a.shape[0] <= 64 else 1})
    full_split = follows_m(xq, xs)
    control_split = [m for m in SWEEP_M if not torch.equal(follows_m(xq[:m], xs[:m]), full_split[:m])]
    print(f"  invariance {n}x{k}: {len(SWEEP_M)} prefixes, differing at M = {bad or 'none'}; permuted 1024 rows "
          f"equal: {permuted}; negative controls differ at {len(control_split)} of {len(SWEEP_M)} M (split "
          f"count following M: must be > 0) and {len(control)} (cuBLAS bf16)", flush=True)


def main() -> None:
    if sys.argv[1:2] == ["--build"]:
        runner()
        return
    from flashinfer.gemm import fp8_blockscale_gemm_sm90

    from bi_core.backends.cuda_common.kernel_calls import fi_act_scales
    from bi_core.kernels.fp8 import fp8_gemm, fp8_linear, quantize_act
    from bi_core.quant.fp8_numerics import dequantize_blocks, quantize_blocks

    sys.path.insert(0, "benchmarks")
    from fp8_kernel_bench import timed_us

    ms = [int(a) for a in sys.argv[1:]] or [1, 8, 64]
    runner()
    dev = torch.device("cuda")
    print(f"{'N x K':>12} {'M':>4} {'linear':>8} {'fi bf16':>8} {'gemm':>8} {'fi gemm':>8}  rel err linear / fi bf16 / "
          f"gemm / fi gemm; fi gemm == our gemm (elements differing)")
    for n, k in SHAPES:
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        wq, ws = quantize_blocks(w.float(), (128, 128))
        wref = dequantize_blocks(wq, ws, (128, 128))

        def fi_gemm(xq, xs, wq=wq, ws=ws):
            return fp8_blockscale_gemm_sm90(xq, wq, fi_act_scales(xs), ws)

        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ wref.t()
            scale = ref.abs().max().item()
            xq, xs = quantize_act(x)
            xs_fi = fi_act_scales(xs)
            fns = (partial(fp8_linear, x, wq, ws), partial(fp8_blockscale_gemm_sm90, x, wq, None, ws),
                   partial(fp8_gemm, xq, xs, wq, ws, torch.bfloat16), partial(fp8_blockscale_gemm_sm90, xq, wq, xs_fi, ws))
            cells, errs, outs = [], [], []
            for fn in fns:
                try:
                    out = fn()
                    torch.cuda.synchronize()
                    outs.append(out)
                    errs.append(f"{(out.float() - ref).abs().max().item() / scale:.1e}")
                    cells.append(f"{timed_us(fn):6.1f}us")
                except Exception as exc:  # a refused shape or layout is a finding, not a stop
                    outs.append(None)
                    errs.append(type(exc).__name__)
                    cells.append(f"{'-':>8}")
                    print(f"    {n}x{k} M={m}: {str(exc).splitlines()[0][:160]}")
            same = "-" if outs[3] is None else int((outs[3] != outs[2]).sum().item())
            print(f"{n:>6}x{k:<5} {m:>4} {' '.join(cells)}  {' / '.join(errs)}; {same}", flush=True)
        try:
            invariance(fi_gemm, n, k, wq, ws, dev)
        except Exception as exc:
            print(f"  invariance {n}x{k}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")


if __name__ == "__main__":
    main()
