#!/usr/bin/env bash
# Decode at 32,000 tokens after the KV chunks went from 256 to 128 tokens (benchmarks section 44:
# FP8 35B-A3B B=1 -2.4%, B=8 +3.2%, B=32 +2.0%: twice the chunk partials). One device call, each
# variant in a fresh process, B=1/8/32:
#   main   this tree
#   cpp8   CHUNKS_PER_PROGRAM 4 -> 8 (a decode program folds up to 8 chunks in series: the same
#          keys a program as with 256-token chunks; scheduling only, no bit moves)
#   cpp2   4 -> 2 (more programs; no bit moves)
#   run32  MERGE_RUN 16 -> 32 (rows past 32 chunks, i.e. 4,096 tokens as before, merge in runs of
#          32: another fold for long rows, so other bits there; a winner needs the long-row GPU
#          tests, tests/gpu/test_kernel_invariance.py -k long)
#   STEP_TIMEOUT=560 bash benchmarks/gpu_run.sh benchmarks/long_ctx_probe.sh   (about 300 s)
# DRY=1: only the variant trees, `bench --help` in each (tests/unit/test_probe_scripts.py).
set -uo pipefail
rc=0
bench=(--config benchmarks/configs/qwen35b_invariant_fp8_32k.yaml --context-len 32000 --batch-sizes 1,8,32 --steps 10
       --throughput none --prefill none)
[ "${DRY:-0}" = 1 ] && bench=(--help)
plan=bi_core/backends/cuda_common/attention.py
bash benchmarks/tree_variants.sh 1 main=. \
  "cpp8=$plan|s/^CHUNKS_PER_PROGRAM = 4 /CHUNKS_PER_PROGRAM = 8 /" \
  "cpp2=$plan|s/^CHUNKS_PER_PROGRAM = 4 /CHUNKS_PER_PROGRAM = 2 /" \
  "run32=bi_core/kernels/attention.py|s/^MERGE_RUN = 16$/MERGE_RUN = 32/" \
  -- "${bench[@]}" 2>&1 | grep -E "^== round|decode B=|variant|usage|Error|error" || rc=1
exit $rc
