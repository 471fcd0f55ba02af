"""Where a graphed decode step's wall time goes: host phases vs the device.

    python3 benchmarks/step_anatomy.py CONFIG [--batch-sizes 1,64,256] [--context-len 512] [--steps 20]

For each batch size: the wall time of a full ``engine.step``, steps back to back (as
``bi-engine bench`` measures it; with ``graph.overlap`` a step launches the next before
returning), the host time of its phases (schedule, plan + pack, launch, wait for the samples,
append), and the device time of the same CUDA graph replayed back to back (no host in between).
``wall - replay`` is what host work in series with the device costs a step: what overlapping the
next step's host work with this step's device work could win at most.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from bi_core import build_engine
from bi_core.config import EngineConfig
from bi_core.runtime.engine import LLMEngine
from bi_core.runtime.sequence import SamplingParams, Status
from bi_core.tools.bench import _prompts, check_decode_rows, main_model_batches


def _timed(obj, name: str, acc: dict, sync: bool = False) -> None:
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        if sync:
            _sync()
        acc[name] += time.perf_counter() - t0
        return out

    setattr(obj, name, wrapper)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def anatomy(engine: LLMEngine, batch: int, context_len: int, steps: int) -> dict:
    params = SamplingParams(max_new_tokens=steps * 2 + 64, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in _prompts(engine, batch, context_len, 0)]
    while any(not s.output_ids for s in seqs):
        engine.step()
    for _ in range(3):
        engine.step()
    with main_model_batches(engine) as batches:
        _sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync()
        wall = (time.perf_counter() - t0) / steps
    check_decode_rows(batches, seqs, steps)  # a figure only for steps of all the rows
    acc: dict = defaultdict(float)
    sched, strategy, runner = engine.scheduler, engine.strategy, engine.runner.main_graphs
    owners = {"schedule": sched, "plan": strategy, "make_context": runner,
              "run": runner,  # launches the replay; returns before the device is done
              "commit": strategy,  # waits for the samples (steps not launched ahead), samples, decides
              "update": sched}  # appends tokens, books progress
    for name, owner in owners.items():
        _timed(owner, name, acc)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync()
    total = (time.perf_counter() - t0) / steps
    for name, owner in owners.items():
        delattr(owner, name)
    phases = {k: acc[k] / steps * 1e3 for k in owners}
    key = min((k for k in getattr(runner, "graphs", {}) if k[0] == 1 and k[1] >= batch), default=None)
    replay_ms = None
    if key is not None and hasattr(runner.graphs[key], "graph"):  # the same graph back to back: device time alone (its inputs are the last step's)
        g = runner.graphs[key]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        g.graph.replay()
        start.record()
        for _ in range(steps):
            g.graph.replay()
        end.record()
        torch.cuda.synchronize()
        replay_ms = start.elapsed_time(end) / steps
    for s in seqs:
        if s.status is Status.RUNNING:
            engine.abort(s.request_id)
    while sched.has_work():
        engine.step()
    return {"batch": batch, "wall_ms": wall * 1e3, "instrumented_ms": total * 1e3,
            "replay_ms": replay_ms, **{f"{k}_ms": v for k, v in phases.items()}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--batch-sizes", default="1,64,256")
    ap.add_argument("--context-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args(argv)
    engine = build_engine(EngineConfig.from_yaml(a.config))
    print(f"== {a.config}: {engine.config.backend}", flush=True)
    for b in (int(x) for x in a.batch_sizes.split(",")):
        r = anatomy(engine, b, a.context_len, a.steps)
        replay = r["replay_ms"]
        host = r["wall_ms"] - replay if replay is not None else float("nan")
        print(f"B={b:4d} wall {r['wall_ms']:7.3f} ms  graph replay alone {replay or float('nan'):7.3f} ms  "
              f"host in series {host:6.3f} ms ({host / r['wall_ms']:.1%})  | phases (instrumented step "
              f"{r['instrumented_ms']:.3f} ms): schedule {r['schedule_ms']:.3f}, make_batch {r['make_batch_ms']:.3f}, "
              f"run (launch) {r['run_ms']:.3f}, sample_and_append (wait + append) {r['sample_and_append_ms']:.3f}",
              flush=True)


if __name__ == "__main__":
    main()
