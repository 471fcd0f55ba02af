#!/usr/bin/env bash
# G3: MTP speculative decoding vs AR, bitwise, on the invariant backend (35B-A3B shape, reduced depth).
set -uo pipefail  # a failing command fails the script, not the tail it pipes into
rc=0
config=${CONFIG:-configs/h100_invariant.yaml}  # e.g. CONFIG=benchmarks/configs/qwen35b_invariant_kvfp8.yaml
python3 -m bi_core.cli verify --config "$config" --num-layers "${1:-8}" --num-prompts 32 \
  --max-new-tokens 24 --strategies ar,mtp --batch-sizes 1,2,3,7,8,15,16,17,32,64 2>&1 | tail -44 || rc=1
exit $rc
