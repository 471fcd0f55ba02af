#!/usr/bin/env bash
# Is the prefill's wall-time spread (benchmarks section 40: 269-458 ms a pass for the same 244 ms of
# kernels, host idle, clocks steady) the CPU the launching thread runs on? Prints the machine's CPU
# and NUMA layout and the GPU's local CPUs, then runs the bench with the process pinned to the GPU's
# NUMA-local CPUs, to the others (when the process may use any), and unpinned, alternating over ROUNDS.
#   bash benchmarks/host_pace_probe.sh ROUNDS CONFIG [BENCH ARGS]   (default: --prefill 8x2048)
set -uo pipefail
rounds=$1; config=$2; shift 2
args=("$@"); [ ${#args[@]} -gt 0 ] || args=(--prefill 8x2048)

expand() {  # a cpulist (0-3,8,10-11) -> one CPU a line
  tr ',' '\n' <<< "$1" | while IFS=- read -r a b; do seq "$a" "${b:-$a}"; done
}
allowed=$(grep Cpus_allowed_list /proc/self/status | cut -f2)
echo "CPUs allowed: $allowed ($(nproc) usable); $(lscpu | grep -i -E '^(model name|socket|numa node)' | tr -s ' ' | paste -sd ';')"
bus=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader | head -1 | tr 'A-F' 'a-f' | sed 's/^0000//')
dev=/sys/bus/pci/devices/$bus
local_cpus=$(cat "$dev/local_cpulist" 2>/dev/null || echo "")
echo "GPU $bus: NUMA node $(cat "$dev/numa_node" 2>/dev/null || echo '?'), local CPUs ${local_cpus:-unknown}"
nvidia-smi topo -m 2>/dev/null | head -4

mine=$(comm -12 <(expand "$allowed" | sort) <(expand "${local_cpus:-$allowed}" | sort) | sort -n | paste -sd,)
other=$(comm -23 <(expand "$allowed" | sort) <(expand "${local_cpus:-$allowed}" | sort) | sort -n | paste -sd,)
variants=(unpinned)
[ -n "$mine" ] && [ -n "$other" ] && variants+=(local remote)
[ -n "$other" ] || echo "every allowed CPU is local to the GPU: no remote variant (pinning cannot explain the spread)"

rc=0
for r in $(seq "$rounds"); do
  for v in "${variants[@]}"; do
    case $v in
      unpinned) pin=() ;;
      local) pin=(taskset -c "$mine") ;;
      remote) pin=(taskset -c "$other") ;;
    esac
    line=$("${pin[@]}" python3 -m bi_core.cli bench --config "$config" --batch-sizes 1 --steps 3 --throughput none \
           "${args[@]}" 2>&1 | grep "prefill .* tok/s") || { echo "round $r $v: FAILED"; rc=1; continue; }
    echo "round $r $v:$line"
  done
done
exit $rc
