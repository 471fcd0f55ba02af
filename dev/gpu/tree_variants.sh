#!/usr/bin/env bash
# One bench over variant trees, each in a fresh process: a variant is this tree's bi_core copied to
# /tmp with sed expressions applied (FILE|SED, several joined by ;;), or another tree (.baseline: the commit before
# the change). Rounds alternate the variants (old, a, b, old, a, b, ...), as the A/Bs in
# dev/benchmarks-history.md do. Usage:
#   bash dev/gpu/tree_variants.sh ROUNDS 'NAME=DIR' 'NAME=FILE|SED' ... -- BENCH ARGS
# e.g. bash dev/gpu/tree_variants.sh 1 old=.baseline new=. \
#   'pairs8=bi_core/kernels/fp8_moe.py|s/^PAIR_TOKENS = 2$/PAIR_TOKENS = 8/' -- --config ...
# A sed expression that changes nothing fails the variant (a stale expression measures nothing).
set -uo pipefail
rounds=$1; shift
names=(); dirs=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do
  name=${1%%=*}; spec=${1#*=}; shift
  if [ -d "$spec" ]; then dir=$(cd "$spec" && pwd)
  else
    dir=/tmp/variant_$name
    rm -rf "$dir" && mkdir -p "$dir" && cp -r bi_core "$dir/" || exit 1
    while [ -n "$spec" ]; do  # FILE|SED;;FILE|SED...: each edit on the copy
      edit=${spec%%;;*}; [ "$edit" = "$spec" ] && spec= || spec=${spec#*;;}
      file=${edit%%|*}; expr=${edit#*|}
      before=$(md5sum < "$dir/$file"); sed -i "$expr" "$dir/$file"
      if [ "$before" = "$(md5sum < "$dir/$file")" ]; then echo "variant $name: '$expr' changed nothing in $file"; exit 1; fi
    done
    echo "variant $name: $(diff -r bi_core "$dir/bi_core" | grep '^>' | head -4 | tr '\n' ' ')"
  fi
  names+=("$name"); dirs+=("$dir")
done
shift || true
rc=0
for r in $(seq "$rounds"); do
  for j in "${!names[@]}"; do
    echo "== round $r: ${names[$j]} (${dirs[$j]})"
    # -P: the working directory (this tree) is not put first on sys.path, so the variant's bi_core is imported
    PYTHONPATH="${dirs[$j]}:${PYTHONPATH:-}" python3 -P -m bi_core.cli bench "$@" 2>&1 \
      | grep -v "UserWarning\|_warn_once" || rc=1
  done
done
exit $rc
