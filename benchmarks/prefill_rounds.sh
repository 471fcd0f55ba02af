#!/usr/bin/env bash
# Prefill tok/s of several configs over ROUNDS rounds, each config in a fresh process, the configs
# alternating (a, b, c, a, b, c, ...): one engine run's prefill figure moved 25% between calls on one
# tree (benchmarks section 39), so a comparison takes every config's rounds. Each line is the
# bench's own prefill line: the median of 3 passes, each pass, and one more pass's kernel time.
#   bash benchmarks/prefill_rounds.sh ROUNDS CONFIG... [-- BENCH ARGS]   (default: --prefill 8x2048)
set -uo pipefail
rounds=$1; shift
configs=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do configs+=("$1"); shift; done
shift || true
args=("$@"); [ ${#args[@]} -gt 0 ] || args=(--prefill 8x2048)
rc=0
for r in $(seq "$rounds"); do
  for c in "${configs[@]}"; do
    line=$(python3 -m bi_core.cli bench --config "$c" --batch-sizes 1 --steps 3 --throughput none "${args[@]}" 2>&1 |
           grep "prefill .* tok/s") || { echo "round $r $c: FAILED"; rc=1; continue; }
    echo "round $r $(basename "$c" .yaml):$line"
  done
done
exit $rc
