"""The invariance tax from alternating processes, for figures whose gap is as small as the spread
between processes (issue 22: at 131k tokens and batch 8, one process a backend gave -4.4% in one
call and +6.9% two calls before; the default backend's own step ranged 11.7-12.7 ms across
machines; benchmarks section 26).

    python3 dev/probes/tax_ab.py --config A.yaml --config B.yaml [--rounds 3] [--json PATH] \\
        -- --batch-sizes 8 --context-len 131000 --throughput none --prefill none

Runs ``bi-engine bench --config X BENCH_ARGS --json ...`` for A, B, A, B, ... (``--rounds``
processes a config, each fresh, alternating so that a drift of the machine falls on both), then
prints for every figure the bench reports (decode ms per step by batch and context, throughput and
prefill tokens/s) each config's values, their median and range, and B's time over A's: from the
medians, and the lowest and highest of the rounds' own pairs (round i's B over round i's A). A tax
is settled when the pairs agree on its side of a target; with them straddling it, more rounds."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_bench(config: str, bench_args: list[str], json_path: str) -> None:
    """One ``bi-engine bench`` process for ``config``; raises with its output's tail if it fails."""
    cmd = [sys.executable, "-m", "bi_core.cli", "bench", "--config", config, *bench_args, "--json", json_path]
    done = subprocess.run(cmd, capture_output=True, text=True)
    sys.stdout.write(done.stdout)
    if done.returncode != 0:
        raise RuntimeError(f"bench of {config} failed (exit {done.returncode}): {(done.stdout + done.stderr)[-2000:]}")


def figures(report: dict) -> dict[str, tuple[float, bool]]:
    """One bench report's figures: name -> (value, whether more is faster)."""
    [cfg] = report["configs"]
    out = {f"decode B={d['batch']} ctx {d['context_len']} ms/step": (d["ms_per_step"], False) for d in cfg["decode"]}
    if "throughput" in cfg:
        out["throughput output tok/s"] = (cfg["throughput"]["output_tokens_per_s"], True)
    if "prefill" in cfg:
        out["prefill tok/s"] = (cfg["prefill"]["prefill_tokens_per_s"], True)
    return out


def time_ratio(a: float, b: float, more_is_faster: bool) -> float:
    """B's time over A's for one figure."""
    return a / b if more_is_faster else b / a


def compare(runs: dict[str, list[dict]], configs: list[str]) -> list[dict]:
    """Per figure: each config's values, median and range; B's time over A's from the medians and
    from each round's pair."""
    rows = []
    for name, (_, faster) in figures(runs[configs[0]][0]).items():
        values = [[figures(r)[name][0] for r in runs[c]] for c in configs]
        pairs = [time_ratio(a, b, faster) for a, b in zip(*values)]
        medians = [statistics.median(v) for v in values]
        rows.append({"figure": name, "values": dict(zip(configs, values)), "medians": dict(zip(configs, medians)),
                     "time_ratio_of_medians": time_ratio(*medians, faster),
                     "time_ratio_pairs": [min(pairs), max(pairs)]})
    return rows


def main(argv: list[str] | None = None, bench=run_bench) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", action="append", required=True, help="exactly two: A (the base) and B")
    ap.add_argument("--rounds", type=int, default=3, help="processes a config (alternating A, B, A, B, ...)")
    ap.add_argument("--json", help="write the rows and every process's report here")
    a = ap.parse_args(argv[:split])
    bench_args = argv[split + 1:]
    if len(a.config) != 2 or a.config[0] == a.config[1]:
        ap.error("--config: give two different configs, A then B")
    if a.rounds < 1:
        ap.error("--rounds: at least 1")
    if "--config" in bench_args or "--json" in bench_args:
        ap.error("after --: bench options other than --config and --json (this script sets them)")
    runs: dict[str, list[dict]] = {c: [] for c in a.config}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.rounds):
            for c in a.config:
                path = str(Path(tmp) / f"{len(runs[c])}_{Path(c).stem}.json")
                print(f"== round {i + 1} of {a.rounds}: {c}", flush=True)
                bench(c, bench_args, path)
                runs[c].append(json.loads(Path(path).read_text()))
    rows = compare(runs, a.config)
    print(f"== {a.config[1]} against {a.config[0]}, {a.rounds} processes each, alternating")
    for r in rows:
        lo, hi = r["time_ratio_pairs"]
        spread = "; ".join(f"{Path(c).stem} median {m:.3f} ({min(v):.3f}-{max(v):.3f})"
                           for (c, v), m in zip(r["values"].items(), r["medians"].values()))
        print(f"  {r['figure']}: {spread}; time {r['time_ratio_of_medians']:.3f}x (pairs {lo:.3f}-{hi:.3f}x)")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "runs": runs}, indent=1))
    return rows


if __name__ == "__main__":
    try:
        main()
    except RuntimeError as e:
        sys.exit(f"tax_ab: {e}")
