#!/usr/bin/env bash
# Merge a call's new Triton cache entries (SAVE_TRITON=new: DIR/triton.part-*) into the carried
# .triton-cache, dropping the carried entries of every kernel the call compiled again (a kernel
# compiled again was missing from the cache: nearly always because its source changed, so its old
# entries are stale). Usage: bash benchmarks/triton_cache_merge.sh DIR_WITH_NEW_PARTS
set -euo pipefail
new_parts=$1
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
mkdir -p "$work/old" "$work/new"
if ls .triton-cache/triton.part-* >/dev/null 2>&1; then cat .triton-cache/triton.part-* | tar -xJ -C "$work/old"; fi
cat "$new_parts"/triton.part-* | tar -xJ -C "$work/new"
# a cache entry is a folder named by its hash, holding NAME.json (its metadata) and __grp__NAME.json
names() { find "$1" -mindepth 2 -maxdepth 2 -name '*.json' ! -name '__grp__*' -printf '%f\n' | sort -u; }
names "$work/new" > "$work/new_names"
dropped=0
for entry in "$work"/old/*/; do
  for f in "$entry"*.json; do
    case "$(basename "$f")" in __grp__*) continue ;; esac
    if grep -qxF "$(basename "$f")" "$work/new_names"; then rm -rf "$entry"; dropped=$((dropped + 1)); break; fi
  done
done
old_kept=$(find "$work/old" -mindepth 1 -maxdepth 1 | wc -l)
cp -r "$work/new/." "$work/old/"
echo "kept $old_kept carried entries, dropped $dropped stale ones, added $(find "$work/new" -mindepth 1 -maxdepth 1 | wc -l)"
tar -c -C "$work/old" . | xz -T0 -6 > "$work/triton.tar.xz"
rm -f .triton-cache/triton.part-*; mkdir -p .triton-cache
split -b 15M "$work/triton.tar.xz" .triton-cache/triton.part-
du -sh .triton-cache
