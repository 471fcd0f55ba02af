#!/usr/bin/env bash
# Merge a call's new Triton cache entries (SAVE_TRITON=new: DIR/triton.part-*) into the carried
# .triton-cache. Where the union's archive is over MAX_MIB (the carry's room), it drops the carried
# entries of every kernel the call compiled again: a kernel compiled again missed the cache, mostly
# because its source changed, but a new specialization also drops its name's valid entries (655 of
# 928 on 2026-11-29: the GPU tests compile many), so the union comes first.
# Usage: [MAX_MIB=24] bash dev/gpu/triton_cache_merge.sh DIR_WITH_NEW_PARTS
set -euo pipefail
new_parts=$1
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
mkdir -p "$work/old" "$work/new"
if ls .triton-cache/triton.part-* >/dev/null 2>&1; then cat .triton-cache/triton.part-* | tar -xJ -C "$work/old"; fi
cat "$new_parts"/triton.part-* | tar -xJ -C "$work/new"
pack() { tar -c -C "$work/merged" . | xz -T0 -6 > "$work/triton.tar.xz"; stat -c %s "$work/triton.tar.xz"; }
mkdir -p "$work/merged"; cp -r "$work/old/." "$work/new/." "$work/merged/"
if [ "$(pack)" -le $(( ${MAX_MIB:-24} << 20 )) ]; then
  echo "union: $(find "$work/old" -mindepth 1 -maxdepth 1 | wc -l) carried entries and $(find "$work/new" -mindepth 1 -maxdepth 1 | wc -l) new"
else
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
rm -rf "$work/merged"; mkdir -p "$work/merged"; cp -r "$work/old/." "$work/new/." "$work/merged/"
echo "over ${MAX_MIB:-24} MiB as a union: kept $old_kept carried entries, dropped $dropped of recompiled kernels," \
  "added $(find "$work/new" -mindepth 1 -maxdepth 1 | wc -l) ($(( $(pack) >> 20 )) MiB)"
fi
rm -f .triton-cache/triton.part-*; mkdir -p .triton-cache
split -b 15M "$work/triton.tar.xz" .triton-cache/triton.part-
du -sh .triton-cache
