#!/usr/bin/env bash
# Tensor parallelism on 2 GPUs (nvidia-h200-x2), one device call: the GPU tests, the invariance
# audit with TP=2 and its negative control (default backend, NCCL), then TP=2 vs TP=1 bench.
# Usage: bash benchmarks/gpu_run.sh benchmarks/tp_gpu.sh   (or the parts: tests | verify | bench)
set -u
parts=${1:-tests,verify,bench}
if [[ $parts == *tests* ]]; then
  timeout 200 python3 -m pytest -q -rf -s --timeout 180 -p no:cacheprovider tests/gpu/test_tp_gpu.py 2>&1 | tail -8
fi
if [[ $parts == *verify* ]]; then
  for neg in "" --negative-control; do
    timeout 150 python3 -m bi_core.cli verify --config benchmarks/configs/qwen35b_invariant_tp2.yaml --num-layers 8 \
      --num-prompts 16 --max-new-tokens 16 --batch-sizes 1,8,64 $neg 2>&1 | grep -v "^\s*$" | tail -14
  done
fi
if [[ $parts == *bench* ]]; then
  timeout 330 python3 -m bi_core.cli bench --config benchmarks/configs/qwen35b_invariant.yaml \
    --config benchmarks/configs/qwen35b_invariant_tp2.yaml --batch-sizes 1,8,64 --steps 10 \
    --throughput 256x512x256 --prefill none 2>&1 | grep -v "^\s*$" | tail -30
fi
