#!/usr/bin/env bash
# All GPU tests (kernels on the GPU, kernel invariance, engine invariance, graphs, reference match).
set -o pipefail  # a failing command fails the script, not the tail it pipes into
rc=0
python3 -m pytest -q -rf --timeout 280 tests/gpu tests/kernels -p no:cacheprovider 2>&1 | tail -15 || rc=1
exit $rc
