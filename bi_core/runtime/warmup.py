"""Engine start-up warm-up: capture every CUDA graph and compile every first-time kernel before
the first request, so none of that lands inside a running batch.

Without it, graph captures and Triton compiles inside prompt and mixed steps took most of a
throughput run's time (dev/benchmarks-history.md). Triton specializes integer
arguments by value (== 1, divisible by 16), so the dummy prompts below give first steps of each
kind: one sequence over a whole chunk, sixteen sequences filling a chunk (the default backend's
fla kernels compiled new variants for 16 x 512 after the other waves), sixteen short ones, a few
odd-sized ones, and a mixed step (a short prompt decoding while a long one still prefills); then
one masked draw (structured outputs' device masks: ``warm_masked_sampler``)."""

from __future__ import annotations

import logging
import time

import attrs
import torch

from bi_core.policies.apply import applied
from bi_core.runtime import gc_heap
from bi_core.runtime.sequence import SamplingParams

log = logging.getLogger(__name__)


@attrs.frozen
class WarmupReport:
    graphs: int  # CUDA graphs captured
    capture_s: float
    prompts: int  # dummy prompts run
    prompts_s: float

    def __str__(self) -> str:
        return (f"warm-up: {self.graphs} CUDA graphs captured in {self.capture_s:.1f} s, "
                f"{self.prompts} dummy prompts run in {self.prompts_s:.1f} s")


def warmup_prompt_lengths(chunk: int, max_num_seqs: int, room: int) -> list[list[int]]:
    """Waves of prompt lengths run one wave after another (see the module docstring)."""
    waves = [[chunk], [max(1, chunk // 16)] * 16, [17] * 16, [5, 7, 9], [3, chunk + chunk // 2]]
    return [[max(1, min(n, room)) for n in wave[:max_num_seqs]] for wave in waves]


def wants_warmup(engine) -> bool:
    """Whether graphs are captured ahead (at start, and again after a sleep): CUDA graphs on a GPU
    with ``graph.warmup``."""
    g = engine.config.graph
    return g.warmup and g.enabled and engine.device.type == "cuda"


def capture_graphs(engine) -> int:
    """Capture every CUDA graph the engine replays: the runner's, then the strategy's own
    programs (which read the runner's graphs' outputs). Returns how many."""
    return engine.runner.capture_graphs() + engine.strategy.capture_graphs()


def warm_masked_sampler(engine) -> torch.Tensor:
    """One masked draw (structured outputs' device masks, an all-allowed mask) over a logits row
    as the model makes them, so the sampler's masked variant is compiled before the first
    constrained request; returns its sample. Every tensor-parallel rank runs it (the logits'
    gather)."""
    vocab, dev = engine.args.vocab_size, engine.device
    hidden = torch.zeros((1, engine.args.hidden_size), dtype=engine.dtype, device=dev)
    logits = engine.model.compute_logits(hidden)
    masks = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32, device=dev)
    return engine.model.sampler.sample_device(logits, torch.zeros(1, dtype=torch.int64, device=dev),
                                              torch.ones(1, dtype=torch.float64, device=dev), masks)


def warm_up(engine) -> WarmupReport:
    """Capture the strategy's graphs, then run the dummy prompts and forget them (results,
    counters, prefix cache). Call it on an idle engine."""
    if engine.requests:
        raise RuntimeError("warm_up needs an idle engine")
    engine.compile_ahead.join()  # the kernels compiled ahead are installed before the first launch
    t0 = time.perf_counter()
    with torch.inference_mode(), applied(engine.policy):
        graphs = capture_graphs(engine)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    t1 = time.perf_counter()
    sched = engine.config.scheduler
    g = torch.Generator().manual_seed(0)
    waves = warmup_prompt_lengths(engine.scheduler.chunk_size, sched.max_num_seqs, engine.max_model_len - 4)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    for lengths in waves:
        engine.generate([torch.randint(0, engine.args.vocab_size, (n,), generator=g).tolist() for n in lengths],
                        params)
    with torch.inference_mode(), applied(engine.policy):
        warm_masked_sampler(engine)
    sync()
    engine.reset_counters()  # the first user request is request 0, as without a warm-up
    gc_heap.freeze()  # what the start built lives as long as the engine
    report = WarmupReport(graphs, t1 - t0, sum(map(len, waves)), time.perf_counter() - t1)
    log.info("%s", report)
    return report
