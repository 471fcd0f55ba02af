#!/usr/bin/env bash
# The measurements dev/notebook.md ("Open work", "Run first") is waiting for, in one step, each
# command's output in $OUT (train_bench.json, vision*.json, lora*.json, pending.log): the changes
# made after the 2026-12-07 GPU run, against the predictions written there.
#   STEP_TIMEOUT=560 bash dev/gpu/gpu_run.sh dev/gpu/pending.sh            (carry .gpu-deps, .fi-jit)
# The lora baseline needs a .baseline tree of the commit before the early exit (carry it too):
#   rm -rf .baseline && mkdir .baseline && git archive 64273d5 bi_core | tar -x -C .baseline
set -uo pipefail
OUT=${OUT:-/tmp/out}
run() { echo "== $* ($(date +%T))"; timeout "${LIMIT:-150}" "$@" 2>&1 | tail -25; }
run python3 -m pytest -q -p no:cacheprovider tests/gpu/test_vision_gpu.py
run python3 benchmarks/vision_bench.py --repeats 5 --json "$OUT/vision.json"
run python3 dev/probes/vision_attention_tune.py
run python3 benchmarks/lora_bench.py --steps 10 --json "$OUT/lora.json"
if [ -d .baseline/bi_core ]; then
  (cd .baseline && ln -sfn ../benchmarks benchmarks && export PYTHONPATH=$PWD:/tmp/site &&
    run python3 benchmarks/lora_bench.py --steps 10 --json "$OUT/lora_old.json")
fi
LIMIT=240 run python3 benchmarks/train_bench.py benchmarks/configs/qwen35b_invariant.yaml --layers 8 --batch 4 \
  --seq-len 4096 --completions 256,1024,4095 --steps 2 --json "$OUT/train_bench.json"
