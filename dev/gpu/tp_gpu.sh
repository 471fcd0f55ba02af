#!/usr/bin/env bash
# Tensor parallelism on 2 GPUs (nvidia-h200-x2): the GPU tests, the collectives' cost, the
# invariance audit with TP=2 and its negative control (default backend, NCCL), then the bench of
# both backends at TP=2.
# Usage: bash dev/gpu/gpu_run.sh "dev/gpu/tp_gpu.sh [tests,collective,verify,negative,bench]"
set -uo pipefail  # a failing command fails the script, not the tail it pipes into
rc=0
parts=${1:-tests,collective,verify,negative,bench}
audit="--num-layers 8 --num-prompts 16 --max-new-tokens 16 --batch-sizes 1,8,64"
if [[ $parts == *tests* ]]; then
  timeout 240 python3 -m pytest -q -rf -s --timeout 220 -p no:cacheprovider tests/gpu/test_tp_gpu.py 2>&1 | tail -8 || rc=1
fi
if [[ $parts == *collective* ]]; then
  timeout 90 python3 benchmarks/kernels/collective_bench.py 2 2>&1 | tail -8 || rc=1
fi
if [[ $parts == *verify* ]]; then
  timeout 170 python3 -m bi_core.cli verify --config benchmarks/configs/qwen35b_invariant_tp2.yaml $audit \
    2>&1 | grep -v "^\s*$" | tail -14 || rc=1
fi
if [[ $parts == *negative* ]]; then
  timeout 150 python3 -m bi_core.cli verify --config benchmarks/configs/qwen35b_invariant_tp2.yaml $audit \
    --negative-control 2>&1 | grep -v "^\s*$" | tail -14 || rc=1
fi
if [[ $parts == *bench* ]]; then
  timeout 330 python3 -m bi_core.cli bench --config benchmarks/configs/qwen35b_invariant_tp2.yaml \
    --config benchmarks/configs/qwen35b_default_tp2.yaml --batch-sizes 1,8,64 --steps 10 \
    --throughput 128x512x128 --prefill none 2>&1 | grep -v "^\s*$" | tail -30 || rc=1
fi
exit $rc
