"""Where a prompt chunk's step goes deep into a long prompt (issue 22: 136-190 ms a step for a
976-token chunk 20-32k tokens in, on both backends, against ~20-30 ms by FLOPs).

    python3 dev/probes/profile_long_chunk.py CONFIG [CONFIG...] [--prompt-len 32000] [--at 20000]

A prompt of ``--prompt-len`` tokens prefills alone until ``--at`` tokens are in the cache; the next
step (one chunk) is timed on the host and profiled (torch profiler, CUDA kernels by total time).
With ``--at 0`` each measured step is a fresh prompt's first chunk (a whole short prompt: its
prefill, e.g. ``--prompt-len 512``)."""

from __future__ import annotations

import argparse
import gc
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from bi_core import EngineConfig, SamplingParams, build_engine


def run(path: str, prompt_len: int, at: int) -> None:
    eng = build_engine(EngineConfig.from_yaml(path))
    g = torch.Generator().manual_seed(0)

    def add(engine=eng):
        return engine.add_request(torch.randint(0, engine.args.vocab_size, (prompt_len,), generator=g).tolist(),
                                  SamplingParams(max_new_tokens=1, ignore_eos=True))
    seq = add()
    while seq.num_computed < at:
        eng.step()
    if at == 0:  # a prompt's first chunk: the first one warms up, the timed and profiled ones are fresh prompts
        eng.step()
        add()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    eng.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3
    if at == 0:
        add()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        eng.step()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            kernels.setdefault(e.name[:90], []).append(e.device_time)
    total = sum(sum(v) for v in kernels.values()) / 1e3
    print(f"== {path}: chunk {eng.scheduler.chunk_size} at {at} of {prompt_len} tokens: step {wall:.1f} ms wall, "
          f"{total:.1f} ms of kernels ({sum(len(v) for v in kernels.values())} launches)", flush=True)
    for name, times in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:15]:
        print(f"  {sum(times) / 1e3:8.2f} ms  {len(times):5d} x  {name}", flush=True)
    cpu = sorted((e for e in prof.key_averages() if e.self_cpu_time_total > 0), key=lambda e: -e.self_cpu_time_total)[:8]
    print("  host (self CPU time): " + ", ".join(f"{e.key[:40]} {e.self_cpu_time_total / 1e3:.1f} ms" for e in cpu))
    eng.close()
    del eng, seq
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--prompt-len", type=int, default=32000)
    ap.add_argument("--at", type=int, default=20000)
    a = ap.parse_args()
    for path in a.configs:
        run(path, a.prompt_len, a.at)


if __name__ == "__main__":
    main()
