"""Benchmarks: decode step latency at fixed batch sizes, offline throughput, prefill throughput
and time to first token, peak memory, and the floors every figure is checked against: the bytes a
decode step must move over the fastest streaming rate measured on this device, the FLOPs a
prefill must do over the matrix rate measured on it. A figure below its floor, a decode step that
did not run every row at the stated context, or a prefill the prefix cache served, is an error
(``BenchError``), never a result. A decode step that takes over HOST_BOUND_RATIO times its kernels'
device time is printed with a ``HOST-BOUND?`` note; a prefill figure (the median of its timed
passes) comes with one more pass's kernel time, for the same reading. Where a step's time goes:
``BI_BENCH_TOP_KERNELS=N`` prints one eager step's N costliest kernels and how many timed steps
replayed a CUDA graph; ``BI_BENCH_PROFILE_HOST=N`` the host's N costliest functions (decode and prefill) over the
timed steps (cProfile)."""

from __future__ import annotations

import contextlib
import os
import statistics
import time

import attrs
import torch

from bi_core.errors import BiEngineError
from bi_core.models.qwen3_5 import local_args
from bi_core.quant.sizing import state_bytes
from bi_core.runtime.engine import LLMEngine
from bi_core.runtime.sequence import SamplingParams, Status
from bi_core.tools.host_probe import HostProbe


class BenchError(BiEngineError):
    """A measurement that cannot be right (below its floor) or did not measure what it states."""


def _sync(engine: LLMEngine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def _median_s(fn, repeats: int = 10) -> float:
    """Median seconds of ``fn`` on the current device (events around each call, after 3 warm-ups)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def measure_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """The fastest streaming rate of device memory in bytes/s: the larger of a device-to-device
    copy (bytes read plus bytes written) and a read-only reduction (a decode step mostly reads,
    and reading alone streams a little faster than copying)."""
    a = torch.randn(nbytes // 4, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    copy = 2 * a.numel() * a.element_size() / _median_s(lambda: b.copy_(a))
    read = a.numel() * a.element_size() / _median_s(lambda: a.sum(dtype=torch.float32))
    return max(copy, read)


def measure_matmul_flops(device: torch.device, n: int = 8192) -> float:
    """bf16 matrix-product rate in FLOP/s (an n x n x n product through torch, i.e. cuBLAS)."""
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device=device) for _ in range(2))
    return 2 * n**3 / _median_s(lambda: a @ b)


def weight_bytes(engine: LLMEngine, batch: int, keep) -> int:
    """Bytes of the parameters whose names ``keep`` accepts that ``batch`` tokens read: routed
    experts only as many as batch*k draws are expected to hit, the shared expert (last) always."""
    a = engine.args
    total = 0
    for name, p in engine.model.named_parameters():
        if not keep(name):
            continue
        if name.endswith(("mlp.w13", "mlp.w2")):
            hit = a.num_experts * (1 - (1 - a.num_experts_per_tok / a.num_experts) ** batch)
            total += int(p[0].numel() * p.element_size() * (hit + p.shape[0] - a.num_experts))
        else:
            total += p.numel() * p.element_size()
    return total


def decode_bytes(engine: LLMEngine, batch: int, context_len: int) -> int:
    """Fewest bytes one decode step of ``batch`` rows at ``context_len`` must move: every weight
    read once (routed experts: the expected number hit by batch*k draws), KV read, GDN state
    read and written, logits rows written. Tensor parallel: one rank's bytes (its shard of the
    weights, its heads' KV and states), which every rank moves at once."""
    a, isz = engine.args, engine.dtype.itemsize
    total = weight_bytes(engine, batch, lambda name: not name.startswith("mtp.") and name != "embed_tokens")
    if a.tie_word_embeddings:
        total += engine.model.embed_tokens.numel() * isz
    total += batch * a.hidden_size * isz  # embedding rows
    # KV bytes per token (the cache's element size: 1 for FP8) and GDN state bytes per sequence,
    # as the cache sizing counts them; the states are read and written
    kv, gdn = state_bytes(a, engine.config, engine.dtype, engine.tp.world, with_mtp=False)
    total += batch * context_len * kv + batch * 2 * gdn
    total += batch * a.vocab_size * 4
    return total


# a timed step over this many times its kernels' device time (one eager step) is flagged host-bound:
# eager kernels under PDL overlap, so their sum runs at or above a graphed step's device time
HOST_BOUND_RATIO = 1.25


@attrs.frozen
class DecodeResult:
    batch: int
    context_len: int
    ms_per_step: float
    tokens_per_s: float
    floor_ms: float
    kernels_per_step: int | None = None
    kernel_ms: float | None = None  # the device time of those kernels (one eager step)

    @property
    def over_floor(self) -> float:
        return self.ms_per_step / self.floor_ms


def _prompts(engine: LLMEngine, n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, engine.args.vocab_size, (n, length), generator=g).tolist()


@contextlib.contextmanager
def main_model_batches(engine: LLMEngine):
    """Yields a list that collects, for every main-model batch the engine packs meanwhile, each
    sequence's (request id, tokens before the step): what a timed step really ran."""
    seen: list[list[tuple[int, int]]] = []
    execute = engine.runner.execute

    def spy(fwd, **kw):
        if fwd.head == "model":
            seen.append([(r.seq.request_id, r.start) for r in fwd.rows])
        return execute(fwd, **kw)

    engine.runner.execute = spy
    try:
        yield seen
    finally:
        del engine.runner.execute


def check_decode_rows(batches: list[list[tuple[int, int]]], seqs: list, steps: int) -> None:
    """Raise ``BenchError`` unless ``steps`` main-model batches ran, each exactly the rows of
    ``seqs``, each past its prompt, and every one of them is still running."""
    ids = {s.request_id: len(s.prompt_ids) for s in seqs}
    bad = [b for b in batches if sorted(r for r, _ in b) != sorted(ids) or any(p < ids[r] for r, p in b)]
    if len(batches) != steps or bad or any(s.status is not Status.RUNNING for s in seqs):
        sizes = sorted({len(b) for b in batches})
        raise BenchError(f"the {steps} timed steps did not all decode the {len(seqs)} rows: {len(batches)} model "
                         f"batches of {sizes} rows, {len(bad)} with other rows or rows short of their prompt; "
                         "the figure would not be what it says (scheduler.max_num_seqs, "
                         "max_num_batched_tokens or the KV cache too small for this batch?)")


def time_decode_steps(engine: LLMEngine, prompts: list[list[int]], steps: int, count_kernels: bool = False
                      ) -> tuple[float, tuple[int, float] | None]:
    """Mean ms of ``steps`` full engine steps (schedule + forward + sample) run back to back once
    every prompt decodes, after 3 warm-up steps (which also capture this bucket's graph); with
    ``count_kernels``, also the device kernels of one such step (``kernels_per_decode_step``).
    Back to back, not one step at a time with the device synchronized: with ``graph.overlap``
    a step launches the next one before returning, and a wait after each step would put the
    host's planning back in series with the device. Raises ``BenchError`` unless every timed step
    ran all the prompts' rows, each past its prompt, and nothing else."""
    room = engine.max_model_len - max(len(p) for p in prompts) - 1
    # every row must still decode in the last timed step: steps, warm-ups, and the steps in which
    # the last prompts prefill while the first ones decode (one chunk each per step at worst)
    chunk = engine.scheduler.chunk_size
    fill = sum(-(-len(p) // chunk) for p in prompts) + len(prompts)
    wanted = steps + 4 + fill
    if wanted * engine.scheduler.decode_tokens > room:
        raise BenchError(f"{len(prompts)} prompts of {max(len(p) for p in prompts)} tokens leave {room} tokens of "
                         f"model.max_model_len={engine.max_model_len}; {steps} timed decode steps need "
                         f"{wanted * engine.scheduler.decode_tokens}: raise max_model_len or lower the context")
    params = SamplingParams(max_new_tokens=wanted * engine.scheduler.decode_tokens, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts]
    while any(not s.output_ids for s in seqs):
        engine.step()
    for _ in range(3):
        engine.step()
    replays = _graph_replays(engine)
    host = _host_profiler()
    with main_model_batches(engine) as batches:
        _sync(engine)
        if host is not None:
            host.enable()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync(engine)
        ms = (time.perf_counter() - t0) / steps * 1e3
        if host is not None:
            host.disable()
    _print_host_profile(host, f"B={len(prompts)}: host profile of {steps} timed steps ({ms:.3f} ms a step)")
    if os.environ.get("BI_BENCH_TOP_KERNELS"):
        print(f"    B={len(prompts)}: {_graph_replays(engine) - replays} of {steps} timed steps replayed a graph; "
              f"{ms:.3f} ms a step")
    check_decode_rows(batches, seqs, steps)
    kernels = kernels_per_decode_step(engine, seqs) if count_kernels else None
    for s in seqs:
        engine.abort(s.request_id)
    return ms, kernels


def _graph_replays(engine: LLMEngine) -> int:
    """Uniform-step graph replays of the main model so far (0 where its graph runner counts none)."""
    return sum(getattr(engine.runner.main_graphs, "num_replays", {}).values())


def _kernel_events(prof) -> list:
    """The device kernels a torch profiler saw (copies and memsets left out)."""
    from torch.autograd import DeviceType

    return [e for e in prof.events() if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))]


def kernels_per_decode_step(engine: LLMEngine, seqs) -> tuple[int, float]:
    """Device kernels of one decode step of ``seqs``: an eager forward (the kernel sequence a CUDA
    graph of the step replays) plus sampling, counted with the torch profiler; returns (how many,
    their device time in ms). It runs the step
    outside the engine's bookkeeping, so those sequences' states move one token ahead: call it
    only when their outputs no longer matter (after timing)."""
    from torch.profiler import ProfilerActivity, profile

    from bi_core.runtime.graphs import graph_runner
    from bi_core.runtime.step import Forward, SeqRows

    # the last computed position again (its KV page exists in every mode; the KV write repeats it),
    # eagerly (graphs off for this call), sampling on the device like a graph
    rows = [SeqRows(s, [s.all_ids[s.num_computed - 1]], s.num_computed - 1, True, (0,), True) for s in seqs]
    runner = engine.runner
    graphs, runner.main_graphs = runner.main_graphs, graph_runner(attrs.evolve(runner.spec, use_graphs=False))
    torch.cuda.synchronize()
    try:
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.execute(Forward(rows)).samples.cpu()
            torch.cuda.synchronize()
    finally:
        runner.main_graphs = graphs
    kernels = _kernel_events(prof)
    top = int(os.environ.get("BI_BENCH_TOP_KERNELS", "0"))  # where the step's time goes (eager: PDL waits included)
    if top:
        totals: dict[str, list[float]] = {}
        for e in kernels:
            totals.setdefault(e.name[:90], []).append(e.device_time_total)
        print(f"    B={len(seqs)}: top kernels of one eager step (us total, calls)")
        for name, ts in sorted(totals.items(), key=lambda kv: -sum(kv[1]))[:top]:
            print(f"      {sum(ts):9.1f} {len(ts):4d}  {name}")
    return len(kernels), sum(e.device_time_total for e in kernels) / 1e3


def bench_decode(engine: LLMEngine, batch: int, context_len: int, steps: int, bandwidth: float,
                 seed: int = 0, count_kernels: bool = True) -> DecodeResult:
    """Decode step latency of ``batch`` rows at ``context_len``, against the bandwidth floor."""
    count_kernels = count_kernels and engine.tp.world == 1  # the count runs a forward on this rank alone
    ms, kernels = time_decode_steps(engine, _prompts(engine, batch, context_len, seed), steps, count_kernels)
    floor = decode_bytes(engine, batch, context_len + 4) / bandwidth * 1e3
    if ms < floor:
        raise BenchError(f"decode B={batch} at {context_len} tokens measured {ms:.3f} ms, below its memory floor "
                         f"{floor:.3f} ms: a measurement bug, not a result")
    return DecodeResult(batch, context_len, ms, batch / ms * 1e3, floor, *(kernels or (None, None)))


def host_bound_note(ms_per_step: float, kernel_ms: float | None) -> str:
    """A warning when a timed step (or prefill pass) takes well over its kernels' device time: the
    device waited for the host (a graphed step whose planning is slow, as the prefix cache's
    eviction once was; the eager prefill's launches: dev/benchmarks-history.md)."""
    if not kernel_ms or ms_per_step <= HOST_BOUND_RATIO * kernel_ms:
        return ""
    return (f"  HOST-BOUND? {ms_per_step / kernel_ms:.2f}x its kernels' {kernel_ms:.2f} ms "
            "(BI_BENCH_PROFILE_HOST=20: where the host's time goes)")


def bench_throughput(engine: LLMEngine, num_requests: int, input_len: int, output_len: int, seed: int = 1) -> dict:
    prompts = _prompts(engine, num_requests, input_len, seed)
    params = SamplingParams(max_new_tokens=output_len, ignore_eos=True)
    warm = _prompts(engine, min(4, num_requests), input_len, seed + 1000)  # other tokens: no prefix-cache hit
    engine.generate(warm, SamplingParams(max_new_tokens=4, ignore_eos=True))
    _sync(engine)
    t0 = time.perf_counter()
    out = engine.generate(prompts, params)
    _sync(engine)
    dt = time.perf_counter() - t0
    generated = sum(len(o.token_ids) for o in out)
    if generated != num_requests * output_len or any(o.num_cached_tokens for o in out):
        raise BenchError(f"throughput: {generated} of {num_requests * output_len} tokens generated, "
                         f"{sum(o.num_cached_tokens for o in out)} prompt tokens from the prefix cache")
    drafted = sum(o.num_draft_tokens for o in out)
    accepted = sum(o.num_accepted_draft_tokens for o in out)
    steps = sum(o.num_verify_steps for o in out)
    spec = {} if not drafted else {"draft_acceptance": accepted / drafted,
                                   "mean_accepted_per_step": accepted / max(1, steps)}
    return {**spec, "requests": num_requests, "input_len": input_len, "output_len": output_len, "seconds": dt,
            "output_tokens_per_s": generated / dt, "total_tokens_per_s": (generated + num_requests * input_len) / dt,
            "requests_per_s": num_requests / dt}


def prefill_flops(engine: LLMEngine, lengths: list[int]) -> float:
    """Fewest FLOPs a prefill of prompts of ``lengths`` must do: every token through every
    projection it uses (routed experts: its k, the shared expert), the causal attention scores
    and values of the full-attention layers, and one logits row per prompt. GDN's own
    arithmetic is left out, so this is a lower bound. Tensor parallel: one rank's share."""
    a = engine.args
    per_token = 0
    for name, p in engine.model.named_parameters():
        if name.startswith(("mtp.", "lm_head")) or name == "embed_tokens" or p.dim() < 2:
            continue
        if name.endswith(("mlp.w13", "mlp.w2")):  # routed experts: k of them, the shared expert (last) always
            per_token += p[0].numel() * (a.num_experts_per_tok + p.shape[0] - a.num_experts)
        else:
            per_token += p.numel()
    heads = local_args(a, engine.tp.world).num_attention_heads
    attn = sum(2 * n * n * heads * a.head_dim for n in lengths) * len(a.full_attention_layers)  # QK^T, PV causal
    head = len(lengths) * a.vocab_size * a.hidden_size // engine.tp.world
    return 2 * per_token * sum(lengths) + attn + 2 * head


PREFILL_PASSES = 3  # timed prefill passes, the median reported: one pass ranged 39.7k-52.5k tok/s on one tree (2026-11-28b)


def _host_profiler():
    """``BI_BENCH_PROFILE_HOST=N``: a cProfile profiler for the timed part (where the host's time
    goes: the launching thread's Python, or its waits), else None."""
    if not os.environ.get("BI_BENCH_PROFILE_HOST"):
        return None
    import cProfile

    return cProfile.Profile()


def _print_host_profile(host, label: str) -> None:
    """The profiler's N costliest functions by their own time (``BI_BENCH_PROFILE_HOST=N``)."""
    if host is None:
        return
    import pstats

    print(f"    {label}")
    pstats.Stats(host).sort_stats("tottime").print_stats(int(os.environ["BI_BENCH_PROFILE_HOST"]))


def _prefill_kernel_seconds(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> float | None:
    """The device time of one more prefill pass's kernels (torch profiler; other fresh prompts):
    beside the passes' wall time it tells a device-bound pass from a host-bound one. None where
    the profiler sees no device (the CPU engine of the tests) or under tensor parallelism."""
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available() or engine.tp.world > 1:
        return None
    _sync(engine)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, params)
        _sync(engine)
    return sum(e.device_time_total for e in _kernel_events(prof)) / 1e6


def bench_prefill(engine: LLMEngine, batch: int, length: int, matmul_flops: float, seed: int = 2,
                  passes: int = PREFILL_PASSES) -> dict:
    """Prefill tokens/s of ``batch`` fresh prompts of ``length`` tokens (and, for one prompt, its
    time to first token), after a warm-up with other prompts of the same shape: the median of
    ``passes`` timed passes, each on its own fresh prompts; never a prompt the prefix cache holds
    (checked). Raises ``BenchError`` below the FLOP floor."""
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    engine.generate(_prompts(engine, batch, length, seed + 1000), params)  # same shapes, other tokens
    floor = prefill_flops(engine, [length] * batch) / matmul_flops
    times = []
    probe = HostProbe()  # where the host's time went, a pass (tools/host_probe.py)
    host = _host_profiler()
    try:
        for i in range(passes):
            prompts = _prompts(engine, batch, length, seed + i)
            _sync(engine)
            if host is not None:
                host.enable()
            probe.start()
            t0 = time.perf_counter()
            out = engine.generate(prompts, params)
            _sync(engine)
            times.append(time.perf_counter() - t0)
            probe.stop()
            if host is not None:
                host.disable()
            cached = sum(o.num_cached_tokens for o in out)
            if cached or any(o.finish_reason != "length" for o in out):
                raise BenchError(f"prefill {batch} x {length}: {cached} prompt tokens came from the prefix cache or a "
                                 "request failed; the figure would not be a prefill")
    finally:
        probe.close()
    dt = statistics.median(times)
    _print_host_profile(host, f"prefill {batch} x {length}: host profile of {passes} timed passes "
                              f"({'/'.join(f'{t * 1e3:.0f}' for t in times)} ms)")
    kernel_s = _prefill_kernel_seconds(engine, _prompts(engine, batch, length, seed + passes), params)
    if min(times) < floor:
        raise BenchError(f"prefill {batch} x {length} measured {min(times) * 1e3:.1f} ms, below its FLOP floor "
                         f"{floor * 1e3:.1f} ms: a measurement bug, not a result")
    result = {"batch": batch, "length": length, "seconds": dt, "prefill_tokens_per_s": batch * length / dt,
              "floor_s": floor, "over_floor": dt / floor, "prefix_cache": engine.cache.prefix is not None,
              "cached_tokens": 0, "pass_seconds": times, "kernel_seconds": kernel_s,
              "host": probe.summary()}
    if batch == 1:
        result["ttft_ms"] = dt * 1e3
    return result
