#!/usr/bin/env bash
# The invariance audit on the dense Qwen3.5-9B shape (random weights, reduced depth) + negative control.
set -uo pipefail  # a failing command fails the script, not the tail it pipes into
rc=0
layers=${1:-8}
python3 -m bi_core.cli verify --config benchmarks/configs/qwen9b_invariant.yaml --num-layers "$layers" \
  --num-prompts 32 --max-new-tokens 24 2>&1 | tail -28 || rc=1
python3 -m bi_core.cli verify --config benchmarks/configs/qwen9b_invariant.yaml --num-layers "$layers" \
  --num-prompts 32 --max-new-tokens 24 --negative-control --batch-sizes 1,8,64,256 2>&1 | tail -12 || rc=1
exit $rc
