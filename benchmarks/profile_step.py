"""Where a decode step's time goes: torch profiler over eager decode steps, top kernels by CUDA time.

python3 benchmarks/profile_step.py BACKEND LAYERS BATCH"""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, __import__("os").path.dirname(__file__))
from decode_quick import config  # noqa: E402

from bi_core import SamplingParams, build_engine


def main() -> None:
    backend, layers, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    eng = build_engine(config(backend, layers, graphs=False, max_seqs=max(64, batch)))
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    seqs = [eng.add_request(torch.randint(0, 248320, (512,), generator=g).tolist(), params) for _ in range(batch)]
    while any(not s.output_ids for s in seqs):
        eng.step()
    for _ in range(3):
        eng.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            eng.step()
        torch.cuda.synchronize()
    print(f"== {backend} layers={layers} batch={batch}: per 5 steps")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60))


if __name__ == "__main__":
    main()
