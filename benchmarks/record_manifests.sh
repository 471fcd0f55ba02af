#!/usr/bin/env bash
# Re-record the shipped compile manifests (bi_core/backends/cuda_common/compile_manifests), each
# start on an empty Triton cache, after a change to the kernels a start compiles or to the graphs
# it captures; archives them as $OUT/manifests.tar (unpack it into bi_core/backends/cuda_common).
#   bash benchmarks/record_manifests.sh [CONFIG...]   (default: the five bf16 configs the manifests ship for)
# The two FP8 manifests are a second call (seven starts do not fit one step's 560 s):
#   bash benchmarks/record_manifests.sh configs/h100_invariant_fp8.yaml benchmarks/configs/qwen35b_invariant_fp8.yaml
set -uo pipefail
configs=("$@")
if [ ${#configs[@]} -eq 0 ]; then
  configs=(benchmarks/configs/qwen35b_default.yaml benchmarks/configs/qwen35b_invariant.yaml
           configs/h100_default.yaml configs/h100_invariant.yaml configs/h100_invariant_mtp.yaml)
fi
rc=0
for c in "${configs[@]}"; do
  cache=$(mktemp -d)
  if TRITON_CACHE_DIR=$cache timeout 150 python3 benchmarks/start_time.py "$c" --record-compiles > "$cache.log" 2>&1; then
    echo "recorded $c: $(grep -o '"engine_start_s": [0-9.]*' "$cache.log")"
  else
    echo "FAILED $c"; tail -5 "$cache.log"; rc=1
  fi
  rm -rf "$cache"
done
# one archive: the device tool brings back a handful of files per call, not six manifests and logs
mkdir -p "${OUT:-/tmp/out}"
tar -cf "${OUT:-/tmp/out}/manifests.tar" -C bi_core/backends/cuda_common compile_manifests
exit $rc
