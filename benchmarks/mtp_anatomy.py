"""Where a speculative (or AR) decode step's wall time goes: device busy vs idle, and what the host
was doing while the device idled (issue 23).

    python3 benchmarks/mtp_anatomy.py [--preset qwen3.5-9b] [--layers N] [--batch 1] [--num-spec 3]
                                      [--draft-vocab-size 32768] [--strategy mtp|ar] [--steps 10]

B sequences of 512-token prompts decode with CUDA graphs (MTP: the head's own drafts; every
verify runs N+1 tokens whatever is accepted). ``--steps`` engine steps run back to back under the torch
profiler, with the engine's phases annotated (schedule, plan, execute, commit, update, the MTP
head). Printed per step: wall time, device busy time (the union of kernels and copies), device
idle time split by the innermost host phase running when each idle gap began, and the host's
waits on the device (synchronize calls). The idle time is what overlapping the host's work with
the device could win at most."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(__file__))
from mtp_bench import config, prompts  # noqa: E402

from bi_core import SamplingParams, build_engine  # noqa: E402

PHASES = [("scheduler", "schedule"), ("scheduler", "update"), ("strategy", "plan"), ("strategy", "commit"),
          ("strategy", "after_update"), ("runner", "execute"), ("runner", "sample")]
SYNCS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")


def annotate(engine) -> None:
    """Wrap the engine's step phases in profiler ranges (instance attributes: the class is untouched)."""
    for owner, name in PHASES:
        obj = getattr(engine, owner)
        fn = getattr(obj, name)

        def wrapped(*a, _fn=fn, _label=f"{owner}.{name}", **k):
            with torch.profiler.record_function(_label):
                return _fn(*a, **k)
        setattr(obj, name, wrapped)


def host_phases(engine, steps: int) -> None:
    """The host's time per phase without any profiler (perf_counter around each call), and the
    path that decides an overlapped step's length: from the moment a verify's samples reach the
    host (``Landing.wait`` returns) to the return of the next model ``execute`` (the next verify
    launched). While it runs the device has only the head's chain to do."""
    from bi_core.runtime import step as step_mod

    sums, marks = defaultdict(float), {"landed": None, "paths": []}
    originals = []
    for owner, name in PHASES:
        obj = getattr(engine, owner)
        fn = getattr(obj, name)

        def timed(*a, _fn=fn, _label=f"{owner}.{name}", **k):
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                sums[_label] += time.perf_counter() - t
                if _label == "runner.execute" and a and getattr(a[0], "head", None) == "model" \
                        and marks["landed"] is not None:
                    marks["paths"].append(time.perf_counter() - marks["landed"])
                    marks["landed"] = None
        originals.append((obj, name, fn))
        setattr(obj, name, timed)
    wait = step_mod.Landing.wait

    def timed_wait(self):
        out = wait(self)
        marks["landed"] = time.perf_counter()
        return out
    step_mod.Landing.wait = timed_wait
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    finally:
        step_mod.Landing.wait = wait
        for obj, name, fn in originals:
            setattr(obj, name, fn)
    print(f"host phases without a profiler (phase wrappers' own cost included), {steps} steps: wall {wall / steps * 1e3:.3f} ms a step")
    for name, sec in sorted(sums.items(), key=lambda x: -x[1]):
        print(f"  {name:24s} {sec / steps * 1e3:7.3f} ms a step")
    paths = sorted(marks["paths"])
    if paths:
        print(f"  last wait on the device -> next verify launched: median {paths[len(paths) // 2] * 1e3:.3f} ms, "
              f"max {paths[-1] * 1e3:.3f} ms over {len(paths)} steps")


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def analyse(trace: dict, steps: int) -> None:
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    step_ranges = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == "engine.step")
    t0, t1 = step_ranges[0][0], step_ranges[-1][1]
    device = union([(e["ts"], e["ts"] + e["dur"]) for e in events
                    if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and t0 <= e["ts"] <= t1])
    busy = sum(b - a for a, b in device)
    notes = sorted(((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                    if e.get("cat") == "user_annotation" and "." in e["name"]), key=lambda x: (x[0], -x[1]))

    def innermost(t: float) -> str:
        best = None
        for a, b, name in notes:
            if a <= t <= b and (best is None or b - a < best[1] - best[0]):
                best = (a, b, name)
        return best[2] if best else "between steps"

    def path(t: float) -> str:
        return ">".join(name for a, b, name in notes if a <= t <= b) or "between steps"

    idle = defaultdict(float)
    edges = [t0] + [x for iv in device for x in iv] + [t1]
    for a, b in zip(edges[0::2], edges[1::2]):
        if b - a > 5:
            idle[innermost(a)] += b - a
    host = defaultdict(float)
    for a, b, name in notes:
        host[name] += b - a
    syncs = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") == "cuda_runtime" and e["name"] in SYNCS and t0 <= e["ts"] <= t1:
            syncs[e["name"]][0] += 1
            syncs[e["name"]][1] += e["dur"]
    launch = {e["args"]["correlation"]: e["ts"] for e in events
              if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    by_phase, by_kernel, by_shape = defaultdict(float), defaultdict(float), defaultdict(float)
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and t0 <= e["ts"] <= t1:
            by_kernel[e["name"][:90]] += e["dur"]
            corr = e.get("args", {}).get("correlation")
            phase = path(launch[corr]) if corr in launch else "unknown launch"
            by_phase[phase] += e["dur"]
            by_shape[(phase.split(">")[-2] if ">" in phase else phase, e["name"][:40],
                      str(e.get("args", {}).get("grid")))] += e["dur"]
    wall = (t1 - t0) / steps
    print(f"per step: wall {wall / 1e3:.3f} ms, device busy {busy / steps / 1e3:.3f} ms "
          f"({busy / (t1 - t0):.0%}), idle {(t1 - t0 - busy) / steps / 1e3:.3f} ms")
    print("device idle, by the host phase running when the gap began (ms per step):")
    for name, us in sorted(idle.items(), key=lambda x: -x[1]):
        print(f"  {name:24s} {us / steps / 1e3:7.3f}")
    print("host time per phase (ms per step, nested phases counted in each):")
    for name, us in sorted(host.items(), key=lambda x: -x[1]):
        print(f"  {name:24s} {us / steps / 1e3:7.3f}")
    print("device time by the host phases that launched it (ms per step):")
    for name, us in sorted(by_phase.items(), key=lambda x: -x[1]):
        print(f"  {name:60s} {us / steps / 1e3:7.3f}")
    print("top kernels (ms per step):")
    for name, us in sorted(by_kernel.items(), key=lambda x: -x[1])[:25]:
        print(f"  {name:90s} {us / steps / 1e3:7.3f}")
    print("top kernels by the phase launching them and grid (ms per step):")
    for (phase, name, grid), us in sorted(by_shape.items(), key=lambda x: -x[1])[:40]:
        print(f"  {phase:22s} {name:40s} {grid:18s} {us / steps / 1e3:7.3f}")
    print("host waits on the device (count and ms per step):")
    for name, (n, us) in sorted(syncs.items()):
        print(f"  {name:24s} {n / steps:5.1f} {us / steps / 1e3:7.3f}")


def replay_ms(engine, batch: int, reps: int = 50) -> None:
    """Device time of each captured graph of this batch's bucket, replayed back to back (no host
    work between): the step's pure device cost per forward kind."""
    for label, graphs in (("model", engine.runner.main_graphs), ("mtp head", engine.runner.mtp_graphs)):
        if graphs is None:
            continue
        for key, graph in sorted(graphs.graphs.items()):
            if len(key) != 2 or key[1] != next(b for b in graphs.buckets if b >= batch):
                continue
            static = graphs.statics[key]
            ctx = static.context(static.load(static.current)) if static.current is not None else None
            if ctx is None:
                continue
            for _ in range(3):
                graph.replay(ctx)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                graph.replay(ctx)
            end.record()
            end.synchronize()
            print(f"graph replay {label} (query len {key[0]}, bucket {key[1]}): {start.elapsed_time(end) / reps:.3f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3.5-9b")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--num-spec", type=int, default=3)
    ap.add_argument("--draft-vocab-size", type=int)
    ap.add_argument("--strategy", default="mtp", choices=["mtp", "ar"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--cprofile", action="store_true", help="also the host's Python time per function over "
                    "--steps steps (cProfile, no torch profiler): what the host does while the device idles")
    ap.add_argument("--phases", action="store_true", help="also the host's time per phase with no profiler, "
                    "and the path from a verify's samples landing to the next verify's launch")
    a = ap.parse_args()
    engine = build_engine(config(a.strategy, a.layers, a.num_spec, a.preset, a.draft_vocab_size))
    params = SamplingParams(max_new_tokens=1000, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts(a.batch)]
    while any(not s.output_ids for s in seqs):
        engine.step()
    for _ in range(5):
        engine.step()
    annotate(engine)
    step = engine.step

    def timed_step():
        with torch.profiler.record_function("engine.step"):
            return step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(a.steps):
        step()
    torch.cuda.synchronize()
    plain = (time.perf_counter() - start) / a.steps * 1e3
    if a.phases:
        host_phases(engine, a.steps)
    if a.cprofile:
        import cProfile
        import io
        import pstats

        prof_host = cProfile.Profile()
        prof_host.enable()
        for _ in range(a.steps):
            step()
        torch.cuda.synchronize()
        prof_host.disable()
        text = io.StringIO()
        stats = pstats.Stats(prof_host, stream=text)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(40)
        print(f"host functions over {a.steps} steps (cProfile; its own overhead included):\n{text.getvalue()}")
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(a.steps):
            timed_step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    print(f"{torch.cuda.get_device_name()}; {a.preset}; layers {a.layers or 'all'}; {a.strategy}; B={a.batch}; "
          f"N={a.num_spec}; draft vocabulary {a.draft_vocab_size or 'full'}")
    print(f"step wall time without the profiler: {plain:.3f} ms")
    analyse(trace, a.steps)
    with torch.inference_mode():
        replay_ms(engine, a.batch)


if __name__ == "__main__":
    main()
