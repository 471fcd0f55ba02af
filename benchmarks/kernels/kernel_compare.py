"""Side-by-side table of ``kernel_bench.py`` results: the tree before a change (``old``) and after
(``new``), same GPU, same session. python3 benchmarks/kernels/kernel_compare.py results.jsonl"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main() -> None:
    rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
    table: dict[tuple, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if "error" in r:
            print(f"ERROR in {r['tree']} {r['group']}: {r['error']}")
            continue
        if r["group"].endswith("-sweep"):
            continue
        table[(r["group"], r["kernel"].split(":")[0] if r["group"] == "gemm" else r["group"], r.get("context"),
               r["batch"])][r["tree"] + (":cublas" if r["kernel"].endswith(":cublas") else "")].append(r)
    print(f"{'group':<10} {'what':<12} {'ctx':>5} {'B':>3} | {'old us':>9} {'TB/s':>5} | {'new us':>9} {'TB/s':>5} "
          f"| {'speedup':>7} | other")
    for (group, what, ctx, b), by in sorted(table.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0, kv[0][3])):
        old, new = by.get("old", []), by.get("new", [])
        o, n = (min(old, key=lambda r: r["us"]) if old else None), (new[0] if new else None)
        others = [r for k, v in by.items() if k not in ("old", "new") for r in v] + new[1:]
        other = "; ".join(f"{r['kernel'].split(':')[-1]} {r['us']:.1f}us" for r in others)
        speed = f"{o['us'] / n['us']:7.2f}x" if o and n else " " * 8
        cell = lambda r: f"{r['us']:9.1f} {r['tb_s']:5.2f}" if r else " " * 15  # noqa: E731
        print(f"{group:<10} {what[:12]:<12} {ctx or '':>5} {b:>3} | {cell(o)} | {cell(n)} | {speed} | {other}")
    for group in ("gemm-sweep", "attn-sweep"):
        sweep = [r for r in rows if r.get("group") == group]
        for name in sorted({r["kernel"] for r in sweep}):
            best = sorted((r for r in sweep if r["kernel"] == name), key=lambda r: r["us"])[:4]
            print(f"{group} {name}: " + "; ".join(f"{r['us']:.1f}us {r['tb_s']:.2f}TB/s {r['config']}" for r in best))
    # the attention config best over all of its cases (sum of times)
    attn = [r for r in rows if r.get("group") == "attn-sweep"]
    totals: dict[str, list[float]] = defaultdict(list)
    for r in attn:
        totals[json.dumps(r["config"], sort_keys=True)].append(r["us"])
    n_cases = max((len(v) for v in totals.values()), default=0)
    ranked = sorted((sum(v), k) for k, v in totals.items() if len(v) == n_cases)
    for total, k in ranked[:5]:
        print(f"attn-sweep total {total:.1f}us over {n_cases} cases: {k}")


if __name__ == "__main__":
    main()
