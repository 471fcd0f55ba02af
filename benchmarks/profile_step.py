"""Where a step's time goes: torch profiler over eager steps, top kernels by CUDA time.

python3 benchmarks/profile_step.py BACKEND LAYERS BATCH [PROMPTS] [--fp8] [--graphs]

``--graphs``: the steps replay CUDA graphs, as the engine runs decode (the profiler records the
kernels inside them). Eager steps launch kernels early under PDL, so a kernel's time includes
waiting for its predecessor; ``BI_PDL=0`` with ``--graphs`` gives each kernel's own time.
BATCH sequences of 512-token prompts decode; with PROMPTS, the profiled step also prefills that
many new 512-token prompts (a throughput run's mixed step; a first such step, unprofiled, warms
the prefill kernels)."""

from __future__ import annotations

import sys
import time

import torch

sys.path.insert(0, __import__("os").path.dirname(__file__))
from decode_quick import config  # noqa: E402

from bi_core import SamplingParams, build_engine


def main() -> None:
    argv = [a for a in sys.argv[1:] if a not in ("--fp8", "--graphs")]  # --fp8: model.quantization fp8 on load
    backend, layers, batch = argv[0], int(argv[1]), int(argv[2])
    prompts = int(argv[3]) if len(argv) > 3 else 0
    eng = build_engine(config(backend, layers, graphs="--graphs" in sys.argv, max_seqs=max(64, batch + 2 * prompts),
                              quantization="fp8" if "--fp8" in sys.argv else None))
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    seqs = [eng.add_request(torch.randint(0, 248320, (512,), generator=g).tolist(), params) for _ in range(batch)]
    while any(not s.output_ids for s in seqs):
        eng.step()
    for _ in range(3):
        eng.step()
    steps = 5
    if prompts:
        for warm in (True, False):  # the first mixed step warms the prefill kernels; the second is profiled
            for _ in range(prompts):
                eng.add_request(torch.randint(0, 248320, (512,), generator=g).tolist(), params)
            if warm:
                eng.step()
        steps = 1
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    print(f"== {backend} layers={layers} batch={batch} prompts={prompts} graphs={'--graphs' in sys.argv} "
          f"PDL={__import__('os').environ.get('BI_PDL', '1')}: per {steps} steps, wall {wall:.1f} ms "
          f"(profiler on)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))


if __name__ == "__main__":
    main()
