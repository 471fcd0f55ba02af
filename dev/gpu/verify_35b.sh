#!/usr/bin/env bash
# The invariance audit on the Qwen3.5-35B-A3B shape (random weights, reduced depth), then its
# negative control on the default backend.
set -uo pipefail  # a failing command fails the script, not the tail it pipes into
rc=0
layers=${1:-8}
python3 -m bi_core.cli verify --config configs/h100_invariant.yaml --num-layers "$layers" --num-prompts 32 \
  --max-new-tokens 24 2>&1 | tail -30 || rc=1
python3 -m bi_core.cli verify --config configs/h100_invariant.yaml --num-layers "$layers" --num-prompts 32 \
  --max-new-tokens 24 --negative-control --batch-sizes 1,8,16,64 2>&1 | tail -14 || rc=1
exit $rc
