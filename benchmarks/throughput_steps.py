"""Where an offline throughput run spends its time, step by step.

    python3 benchmarks/throughput_steps.py CONFIG [--requests 256 --input-len 512 --output-len 256]

Runs the same workload as `bi-engine bench --throughput NxIxO`, stepping the engine by hand and
timing every step (device synchronized), classified by kind:
  prefill   every row is a prompt chunk
  mixed     prompt chunks and decode rows together (an eager step)
  decode-g  decode rows only, replaying a CUDA graph
  decode-e  decode rows only, eager (no graph for this shape)
  capture   a step that captured a new graph
(each step followed by a device sync: with ``graph.overlap`` a decode step's host planning is then
in series again, so the total here runs slower than ``bench``'s unsynchronized run; compare totals
only with overlap off, or use ``bench``), and, per kind, how many steps compiled a Triton kernel (a fresh TRITON_CACHE_DIR is watched) and
the time those steps took. Prints a table per kind and the 15 slowest steps.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import defaultdict

if "TRITON_CACHE_DIR" not in os.environ:  # a fresh cache: every compile in this run leaves a new entry
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-profile-")

import torch  # noqa: E402

from bi_core import build_engine  # noqa: E402
from bi_core.config import EngineConfig  # noqa: E402
from bi_core.runtime.sequence import SamplingParams  # noqa: E402
from bi_core.tools.bench import _prompts  # noqa: E402


def _compiled() -> int:
    return len(os.listdir(os.environ["TRITON_CACHE_DIR"]))


def _kernel_names(skip: int) -> list[str]:
    """Names of the kernels compiled after the first ``skip`` cache entries (oldest first)."""
    root = os.environ["TRITON_CACHE_DIR"]
    entries = sorted(os.listdir(root), key=lambda e: os.path.getmtime(os.path.join(root, e)))[skip:]
    names = set()
    for e in entries:
        names.update(f.rsplit(".", 1)[0] for f in os.listdir(os.path.join(root, e)) if f.endswith(".json")
                     and not f.startswith("__grp__"))
    return sorted(names)


def _replays(runner) -> int:
    return sum(getattr(runner, "num_replays", {}).values())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    a = ap.parse_args(argv)
    engine = build_engine(EngineConfig.from_yaml(a.config))
    print(f"== {a.config}: {engine.policy.backend}, invariant={engine.policy.batch_invariant}", flush=True)
    print(f"{engine.warmup}; compiles so far {_compiled()}", flush=True)
    slow = sorted(getattr(engine.runner.main_graphs, "capture_s", {}).items(), key=lambda kv: -kv[1])[:4]
    if slow:
        print("slowest captures: " + ", ".join(f"L={k[0]} B={k[1]} {t:.2f} s" for k, t in slow), flush=True)
    engine.generate(_prompts(engine, 4, a.input_len, 9), SamplingParams(max_new_tokens=4, ignore_eos=True))
    seen: list = []
    inner = engine.strategy.plan

    def spy(scheduled):
        seen[:] = [(s.num_tokens, s.recurrent, s.seq.is_decoding) for s in scheduled]
        return inner(scheduled)

    engine.strategy.plan = spy  # (steps launched ahead are not planned here: they keep the last rows)
    params = SamplingParams(max_new_tokens=a.output_len, ignore_eos=True)
    for p in _prompts(engine, a.requests, a.input_len, 1):
        engine.add_request(p, params)
    runner = engine.runner.main_graphs
    rows, replays = [], _replays(runner)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    t_start = time.perf_counter()
    while engine.scheduler.has_work():
        graphs, compiled = len(getattr(runner, "graphs", ())), _compiled()
        t0 = time.perf_counter()
        engine.step()
        sync()
        dt = time.perf_counter() - t0
        decode = [n for n, rec, dec in seen if dec]
        prompt_tokens = sum(n for n, rec, dec in seen if not dec)
        if len(getattr(runner, "graphs", ())) > graphs:
            kind = "capture"
        elif not decode:
            kind = "prefill"
        elif prompt_tokens:
            kind = "mixed"
        else:
            kind = "decode-g" if _replays(runner) > replays else "decode-e"
        replays = _replays(runner)
        new = _compiled() - compiled
        if new:
            print(f"  step {len(rows)} ({kind}, {len(seen)} seqs, {len(decode)} decode rows, {dt * 1e3:.0f} ms) "
                  f"compiled: {', '.join(_kernel_names(compiled))}", flush=True)
        rows.append((kind, dt, len(seen), prompt_tokens, len(decode), new))
    total = time.perf_counter() - t_start
    out_tokens = a.requests * a.output_len
    print(f"total {total:.2f} s, {out_tokens / total:.0f} out tok/s, {len(rows)} steps, "
          f"{_compiled()} Triton cache entries")
    by = defaultdict(list)
    for r in rows:
        by[r[0]].append(r)
    print(f"{'kind':9} {'steps':>6} {'total s':>8} {'share':>6} {'median ms':>9} {'max ms':>8} "
          f"{'compiling steps':>15} {'their s':>8}")
    for kind, rs in sorted(by.items(), key=lambda kv: -sum(r[1] for r in kv[1])):
        ts = sorted(r[1] for r in rs)
        comp = [r for r in rs if r[5]]
        print(f"{kind:9} {len(rs):6d} {sum(ts):8.2f} {sum(ts) / total:6.1%} {ts[len(ts) // 2] * 1e3:9.2f} "
              f"{ts[-1] * 1e3:8.1f} {len(comp):15d} {sum(r[1] for r in comp):8.2f}")
    print("slowest steps (kind, ms, seqs, prompt tokens, decode rows, new Triton entries):")
    for r in sorted(rows, key=lambda r: -r[1])[:15]:
        print(f"  {r[0]:9} {r[1] * 1e3:8.1f} {r[2]:4d} {r[3]:6d} {r[4]:4d} {r[5]:3d}")
    # decode-step time against batch size: is the tail (few sequences left) slow per token?
    dec = [r for r in rows if r[0] == "decode-g"]
    for lo, hi in ((1, 16), (17, 64), (65, 128), (129, 256)):
        sel = [r[1] for r in dec if lo <= r[4] <= hi]
        if sel:
            sel.sort()
            print(f"  decode-g B in [{lo},{hi}]: {len(sel)} steps, median {sel[len(sel) // 2] * 1e3:.2f} ms, "
                  f"sum {sum(sel):.2f} s")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
