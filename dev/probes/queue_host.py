"""Host time of an engine step with N requests queued (RL rollouts queue thousands): the step's
wall time minus its model forward, on any device (the CPU reference engine by default). A
scheduler that scans the queue each step shows it growing with N.

    python3 dev/probes/queue_host.py [N ...] [--config configs/cpu_reference.yaml]   (default N = 10 2000 20000)
    python3 dev/probes/queue_host.py 100 5000 --prompt-len 600 --max-seqs 32

The default is short prompts behind a full batch of 8 (admission stops at the first: no slot);
``--prompt-len 600 --max-seqs 32``: long prompts whose chunks fill the budget while slots are free
(each queued prompt is a prefix lookup that finds its chunk too big for what is left)."""

from __future__ import annotations

import argparse
import random
import time

import attrs

from bi_core import EngineConfig, SamplingParams, build_engine


def host_ms(config: str, queued: int, prompt_len: int | None = None, max_seqs: int = 8, steps: int = 50
            ) -> tuple[float, float]:
    cfg = EngineConfig.from_yaml(config)
    cfg = attrs.evolve(cfg, scheduler=attrs.evolve(cfg.scheduler, max_num_seqs=max_seqs, max_num_batched_tokens=256))
    eng = build_engine(cfg)
    execute, spent = eng.runner.execute, [0.0]

    def timed(fwd, **kw):
        t = time.perf_counter()
        out = execute(fwd, **kw)
        spent[0] += time.perf_counter() - t
        return out

    eng.runner.execute = timed
    rng = random.Random(0)
    for _ in range(queued):
        eng.add_request([rng.randrange(1, 200) for _ in range(prompt_len or rng.randrange(8, 40))],
                        SamplingParams(max_new_tokens=64, ignore_eos=True))
    for _ in range(20):
        eng.step()
    spent[0] = 0.0
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    step = (time.perf_counter() - t) / steps * 1e3
    return step, step - spent[0] / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("queued", nargs="*", type=int, default=[10, 2000, 20000])
    ap.add_argument("--config", default="configs/cpu_reference.yaml")
    ap.add_argument("--prompt-len", type=int, default=None, help="every prompt this long (default: 8-39 tokens)")
    ap.add_argument("--max-seqs", type=int, default=8)
    args = ap.parse_args()
    for n in args.queued:
        step, host = host_ms(args.config, n, args.prompt_len, args.max_seqs, steps=50 if args.prompt_len is None else 10)
        print(f"queued {n}: step {step:.2f} ms, host {host:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
