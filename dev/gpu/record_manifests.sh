#!/usr/bin/env bash
# Re-record the shipped compile manifests (bi_core/backends/cuda_common/compile_manifests), each
# start on an empty Triton cache, after a change to the kernels a start compiles or to the graphs
# it captures; archives them as $OUT/manifests.tar (unpack it into bi_core/backends/cuda_common).
#   bash dev/gpu/record_manifests.sh [CONFIG...]   (default: the five bf16 configs the manifests ship for)
# The two FP8 manifests are a second call (seven starts do not fit one step's 560 s):
#   bash dev/gpu/record_manifests.sh configs/h100_invariant_fp8.yaml benchmarks/configs/qwen35b_invariant_fp8.yaml
# WARM=1: each start on the machine's Triton cache (gpu_run.sh restores the carried one there)
# instead of an empty one: Triton calls the recording's hook for a kernel loaded from its disk
# cache as for one it compiles, with the same hash and specialization, so the manifest is the
# same, and a start takes 30-40 s, not 75-95 (its engine_start_s is then not a fresh machine's).
set -uo pipefail
configs=("$@")
if [ ${#configs[@]} -eq 0 ]; then
  configs=(benchmarks/configs/qwen35b_default.yaml benchmarks/configs/qwen35b_invariant.yaml
           configs/h100_default.yaml configs/h100_invariant.yaml configs/h100_invariant_mtp.yaml)
fi
rc=0
for c in "${configs[@]}"; do
  log=$(mktemp)
  if [ "${WARM:-0}" = 1 ]; then cache=${TRITON_CACHE_DIR:-$HOME/.triton/cache}; else cache=$(mktemp -d); fi
  if TRITON_CACHE_DIR=$cache timeout 150 python3 benchmarks/start_time.py "$c" --record-compiles > "$log" 2>&1; then
    echo "recorded $c: $(grep -o '"engine_start_s": [0-9.]*' "$log")$([ "${WARM:-0}" = 1 ] && echo ' (warm cache)')"
  else
    echo "FAILED $c"; tail -5 "$log"; rc=1
  fi
  [ "${WARM:-0}" = 1 ] || rm -rf "$cache"
  rm -f "$log"
done
# one archive: the device tool brings back a handful of files per call, not six manifests and logs
mkdir -p "${OUT:-/tmp/out}"
tar -cf "${OUT:-/tmp/out}/manifests.tar" -C bi_core/backends/cuda_common compile_manifests
exit $rc
