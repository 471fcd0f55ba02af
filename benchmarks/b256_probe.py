"""Why a process whose start compiled its Triton kernels ran decode B=256 slower (benchmarks section
25): times B=256 decode steps twice as the bench does, with the oldest-generation GC pauses in
each run, then profiles 5 more steps (graph replays): top kernels by device time.

    python3 benchmarks/b256_probe.py CONFIG [BATCH] [--unfreeze]

``--unfreeze`` undoes the engine's end-of-start ``gc.freeze`` (the tree before the fix)."""
import collections
import gc
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bi_core import EngineConfig, SamplingParams, build_engine
from bi_core.tools.bench import _prompts, time_decode_steps

t0 = time.perf_counter()
engine = build_engine(EngineConfig.from_yaml(sys.argv[1]))
print(f"start {time.perf_counter() - t0:.1f} s, objects tracked {len(gc.get_objects())}, frozen {gc.get_freeze_count()}")
if "--unfreeze" in sys.argv:
    gc.unfreeze()
pauses: list[float] = []
began = [0.0]


def _gc_timer(phase, info):
    if info["generation"] == 2:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            pauses.append(time.perf_counter() - began[0])


gc.callbacks.append(_gc_timer)
args = [a for a in sys.argv[2:] if not a.startswith("--")]
batch = int(args[0]) if args else 256
for _ in range(2):
    pauses.clear()
    ms, _ = time_decode_steps(engine, _prompts(engine, batch, 512, 0), 20)
    print(f"decode B={batch}: {ms:.3f} ms/step; oldest-generation collections {len(pauses)}, "
          f"{sum(pauses) * 1e3:.0f} ms in all")
seqs = [engine.add_request(p, SamplingParams(max_new_tokens=64, ignore_eos=True)) for p in _prompts(engine, batch, 512, 1)]
while any(not s.output_ids for s in seqs):
    engine.step()
for _ in range(3):
    engine.step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
tot = collections.Counter()
cnt = collections.Counter()
for e in prof.events():
    if e.device_type.name == "CUDA":
        tot[e.name[:90]] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        cnt[e.name[:90]] += 1
print(f"device time per step {sum(tot.values()) / 5 / 1e3:.3f} ms, kernels per step {sum(cnt.values()) / 5:.0f}")
for name, us in tot.most_common(18):
    print(f"  {us / 5:9.1f} us/step  x{cnt[name] / 5:5.1f}  {name}")
