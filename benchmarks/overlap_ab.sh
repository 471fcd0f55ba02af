#!/usr/bin/env bash
# graph.overlap A/B on the invariant 35B-A3B bench config: overlap off, then on, each in a fresh
# process (docs/notes.md gap 2: a config measured after another in one process runs slower).
# Usage: bash benchmarks/overlap_ab.sh [CONFIG] [BENCH ARGS...]
set -uo pipefail  # a failing bench fails the script, not the grep it pipes into
rc=0
cfg=${1:-benchmarks/configs/qwen35b_invariant.yaml}; shift || true
args=${*:---batch-sizes 1,8,64,256 --steps 20 --throughput 256x512x256 --prefill none}
off=/tmp/$(basename "$cfg" .yaml)_no_overlap.yaml
python3 - "$cfg" "$off" <<'PY'
import sys, yaml
d = yaml.safe_load(open(sys.argv[1]))
d.setdefault("graph", {})["overlap"] = False
yaml.safe_dump(d, open(sys.argv[2], "w"))
PY
for c in "$off" "$cfg"; do
  echo "== $c"
  python3 -m bi_core.cli bench --config "$c" $args 2>&1 | grep -v "UserWarning\|_warn_once" || rc=1
done
exit $rc
