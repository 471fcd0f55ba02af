#!/usr/bin/env bash
# FP8 decode at B=1 (issue 25's 2.0 ms target; 2.81 ms in benchmarks section 43): one device call
# that measures where the next 0.1-0.3 ms could come from, each candidate against this tree.
#   1. the dense FP8 decode GEMMs' tiles with weights from HBM (fp8_kernel_bench --sweep --cold): the
#      tiles were picked from warm-L2 sweeps, and the step's GEMMs take 1.6x the warm time;
#   2. the routed experts per pair, cold (--moe --cold), at 1 and 8 tokens;
#   3. variants of this tree, each in a fresh process, at B=1/8/64: decode attention's chain (at B=1,
#      ctx 512, 4 programs each fold 8 blocks of 32 keys in series: 20 us a layer for 1 MB): KV_SPLIT
#      128 (twice the programs, half the chain) and BLOCK_N 64 (half the chain); and "dense64": the
#      FP8 dense split counts planned against the swapped decode tile's 64 columns, not 32 (the
#      12352 x 2048 and 9216 x 2048 projections then run 2 K ranges: 386 and 288 programs at M = 1
#      instead of 193 and 144 on 132 SMs). Each is a fixed constant, so every variant stays
#      batch-invariant, but each is another arithmetic: a winner needs the GPU tests of its kernels
#      and the audits before it merges.
#   bash benchmarks/b1_probe.sh [CONFIG]   (default: benchmarks/configs/qwen35b_invariant_fp8.yaml)
# About 400 s on a machine with the carried Triton cache (STEP_TIMEOUT=560 through gpu_run.sh).
# DRY=1: only build the variant trees and run `bench --help` in each (tests/unit/test_probe_scripts.py:
# a sed that no longer matches fails there, not on the device).
set -uo pipefail
config=${1:-benchmarks/configs/qwen35b_invariant_fp8.yaml}
rc=0
bench=(--config "$config" --batch-sizes 1,8,64 --steps 20 --throughput none --prefill none)
if [ "${DRY:-0}" = 1 ]; then bench=(--help); else
  timeout 150 python3 benchmarks/fp8_kernel_bench.py --sweep --cold 1 2>&1 | tail -16 || rc=1
  timeout 120 python3 benchmarks/fp8_kernel_bench.py --moe --cold 1 8 2>&1 | tail -16 || rc=1
fi
attention=bi_core/kernels/attention.py
bash benchmarks/tree_variants.sh 1 main=. \
  "kv128=$attention|s/^KV_SPLIT = 256 /KV_SPLIT = 128 /" \
  "bn64=$attention|s/^BLOCK_N = 32$/BLOCK_N = 64/" \
  "dense64=bi_core/kernels/fp8.py|s/triton.cdiv(n, DECODE_BLOCK_N), 1$/triton.cdiv(n, 64), 1/" \
  -- "${bench[@]}" 2>&1 | grep -E "^== round|decode B=|variant|usage|Error|error" || rc=1
exit $rc
