#!/usr/bin/env bash
# GPU kernel tests that need no FlashInfer JIT (ring kernels, invariance of every Triton kernel).
set -o pipefail  # a failing command fails the script, not the tail it pipes into
rc=0
python3 -m pytest -q -rf --timeout 100 tests/kernels tests/gpu/test_kernel_invariance.py \
  -k "not attention_negative_control" -p no:cacheprovider 2>&1 | tail -8 || rc=1
exit $rc
