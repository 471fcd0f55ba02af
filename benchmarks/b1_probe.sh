#!/usr/bin/env bash
# FP8 decode at B=1 (issue 25's 2.0 ms target; 2.81 ms in benchmarks section 43): one device call
# that measures where the next 0.1-0.3 ms could come from, each candidate against this tree.
#   1. the dense FP8 decode GEMMs' tiles with weights from HBM (fp8_kernel_bench --sweep --cold): the
#      tiles were picked from warm-L2 sweeps, and the step's GEMMs take 1.6x the warm time;
#   2. the routed experts per pair, cold (--moe --cold), at 1 and 8 tokens;
#   3. this tree against "kv256" (decode attention's KV chunks at 256 tokens, main's before
#      benchmarks section 44), each in a fresh process, at B=1/8/64: that the 128-token chunks
#      still pay on this tree. Section 44 measured three more variants here and dropped them:
#      BLOCK_N 64 (no change), the FP8 dense split counts planned against 64 columns (B=1 +0.155
#      ms) and KV_SPLIT 64 (lost at 32k tokens).
#   bash benchmarks/b1_probe.sh [CONFIG]   (default: benchmarks/configs/qwen35b_invariant_fp8.yaml)
# About 170 s on a machine with the carried Triton cache (STEP_TIMEOUT=560 through gpu_run.sh).
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
  "kv256=$attention|s/^KV_SPLIT = 128$/KV_SPLIT = 256/" \
  -- "${bench[@]}" 2>&1 | grep -E "^== round|decode B=|variant|usage|Error|error" || rc=1
exit $rc
