"""Host time of the prefill's per-token Python (benchmarks section 41): ``plan_batch`` for one
4 x 2048-token step and ``as_ints`` for 8 x 2048-token prompts, best of 5 x 20 calls. Pure host
work, so any machine measures it; compare trees with PYTHONPATH=<tree>.

  python3 dev/probes/host_plan_bench.py"""

from __future__ import annotations

import random
import timeit

from bi_core.runtime.batch import plan_batch
from bi_core.runtime.prompts import as_ints


def best_ms(fn, number: int = 20, repeat: int = 5) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e3


def main() -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(248000) for _ in range(2048)] for _ in range(8)]
    pages = [list(range(i * 128, (i + 1) * 128)) for i in range(4)]  # 16-token pages
    step = lambda: plan_batch(prompts[:4], [0] * 4, pages, [0, 1, 2, 3], [False] * 4, block_size=16)
    check = lambda: [as_ints(p, "prompt") for p in prompts]
    print(f"plan_batch, a 4 x 2048-token step: {best_ms(step):.2f} ms")
    print(f"as_ints, 8 x 2048-token prompts:   {best_ms(check):.2f} ms")


if __name__ == "__main__":
    main()
