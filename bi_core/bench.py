"""Benchmarks: decode step latency at fixed batch sizes, offline throughput, prefill throughput,
peak memory, and the memory-bandwidth floor of a decode step (bytes that must be read or written
per step over the copy bandwidth measured on this device)."""

from __future__ import annotations

import statistics
import time

import attrs
import torch

from bi_core.runtime.engine import LLMEngine
from bi_core.runtime.sequence import SamplingParams, Status


def measure_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    a = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return nbytes / statistics.median(times)


def decode_bytes(engine: LLMEngine, batch: int, context_len: int) -> int:
    """Fewest bytes one decode step of ``batch`` rows at ``context_len`` must move: every weight
    read once (routed experts: the expected number hit by batch*k draws), KV read, GDN state
    read and written, logits rows written. Tensor parallel: one rank's bytes (its shard of the
    weights, its heads' KV and states), which every rank moves at once."""
    from bi_core.models.qwen3_5 import local_args

    a, isz = engine.args, engine.dtype.itemsize
    heads = local_args(a, engine.tp.world)
    total = 0
    for name, p in engine.model.named_parameters():
        if name.startswith("mtp.") or name == "embed_tokens":
            continue
        if name.endswith(("mlp.w13", "mlp.w2")):  # routed experts hit by batch*k draws, the shared expert (last) always
            hit = a.num_experts * (1 - (1 - a.num_experts_per_tok / a.num_experts) ** batch)
            per_expert = p[0].numel() * p.element_size()
            total += int(per_expert * (hit + p.shape[0] - a.num_experts))
        else:
            total += p.numel() * p.element_size()
    if a.tie_word_embeddings:
        total += engine.model.embed_tokens.numel() * isz
    total += batch * a.hidden_size * isz  # embedding rows
    kv = 2 * heads.num_key_value_heads * a.head_dim * isz * len(a.full_attention_layers)
    total += batch * context_len * kv
    state_bytes = 2 if engine.config.cache.ssm_state_dtype == "bfloat16" else 4
    state = heads.linear_num_value_heads * a.linear_key_head_dim * a.linear_value_head_dim * state_bytes
    conv = heads.conv_dim * (a.linear_conv_kernel_dim - 1) * isz
    total += batch * len(a.gdn_layers) * 2 * (state + conv)
    total += batch * a.vocab_size * 4
    return total


@attrs.frozen
class DecodeResult:
    batch: int
    context_len: int
    ms_per_step: float
    tokens_per_s: float
    floor_ms: float
    kernels_per_step: int | None = None

    @property
    def over_floor(self) -> float:
        return self.ms_per_step / self.floor_ms


def _prompts(engine: LLMEngine, n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, engine.args.vocab_size, (n, length), generator=g).tolist()


def time_decode_steps(engine: LLMEngine, prompts: list[list[int]], steps: int, count_kernels: bool = False
                      ) -> tuple[float, int | None]:
    """Mean ms of ``steps`` full engine steps (schedule + forward + sample) run back to back once
    every prompt decodes, after 3 warm-up steps (which also capture this bucket's graph); with
    ``count_kernels``, also the device kernels of one such step (``kernels_per_decode_step``).
    Back to back, not one step at a time with the device synchronized: with ``graph.overlap``
    a step launches the next one before returning, and a wait after each step would put the
    host's planning back in series with the device."""
    # Long enough that the first requests admitted are still decoding once the last has prefilled
    # (one prefill chunk of the budget per step, plus one admission per step at worst).
    budget = engine.config.scheduler.max_num_batched_tokens
    fill = -(-sum(len(p) for p in prompts) // budget) + len(prompts)
    room = engine.max_model_len - max(len(p) for p in prompts) - 1
    params = SamplingParams(max_new_tokens=max(1, min(steps + 8 + fill, room)), ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts]
    while any(not s.output_ids for s in seqs):
        engine.step()
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / steps * 1e3
    running = [s for s in seqs if s.status is Status.RUNNING]  # early-admitted ones may have finished
    kernels = kernels_per_decode_step(engine, running) if count_kernels and running else None
    while engine.scheduler.has_work():
        engine.step()
    return ms, kernels


def kernels_per_decode_step(engine: LLMEngine, seqs) -> int:
    """Device kernels of one decode step of ``seqs``: an eager forward (the kernel sequence a CUDA
    graph of the step replays) plus sampling, counted with the torch profiler. It runs the step
    outside the engine's bookkeeping, so those sequences' states move one token ahead: call it
    only when their outputs no longer matter (after timing)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from bi_core.ops.sampling import mix_seed
    from bi_core.runtime.batch import plan_batch, upload

    # the last computed position again (its KV page exists in every mode; the KV write repeats it)
    hb = plan_batch([[s.all_ids[s.num_computed - 1]] for s in seqs], [s.num_computed - 1 for s in seqs],
                    [s.blocks for s in seqs], [s.state_slot for s in seqs], [True] * len(seqs),
                    block_size=engine.cache.block_size, ring=engine.cache.state_ring, logits_rows=[[0]] * len(seqs),
                    sample_keys=[mix_seed(s.seed, s.num_tokens) for s in seqs],
                    temperatures=[s.params.temperature for s in seqs])
    ids, ctx = upload(hb, engine.device)  # an eager context (no graph key), sampling on the device like a graph
    torch.cuda.synchronize()
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.run_model(ids, ctx).samples.cpu()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset")))


def bench_decode(engine: LLMEngine, batch: int, context_len: int, steps: int, bandwidth: float,
                 seed: int = 0, count_kernels: bool = True) -> DecodeResult:
    """Decode step latency of ``batch`` rows at ``context_len``, against the bandwidth floor."""
    count_kernels = count_kernels and engine.tp.world == 1  # the count runs a forward on this rank alone
    ms, kernels = time_decode_steps(engine, _prompts(engine, batch, context_len, seed), steps, count_kernels)
    floor = decode_bytes(engine, batch, context_len + 4) / bandwidth * 1e3
    return DecodeResult(batch, context_len, ms, batch / ms * 1e3, floor, kernels)


def bench_throughput(engine: LLMEngine, num_requests: int, input_len: int, output_len: int, seed: int = 1) -> dict:
    prompts = _prompts(engine, num_requests, input_len, seed)
    params = SamplingParams(max_new_tokens=output_len, ignore_eos=True)
    engine.generate(prompts[: min(4, num_requests)], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = engine.generate(prompts, params)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    generated = sum(len(o.token_ids) for o in out)
    drafted = sum(o.num_draft_tokens for o in out)
    accepted = sum(o.num_accepted_draft_tokens for o in out)
    steps = sum(o.num_verify_steps for o in out)
    spec = {} if not drafted else {"draft_acceptance": accepted / drafted,
                                   "mean_accepted_per_step": accepted / max(1, steps)}
    return {**spec, "requests": num_requests, "input_len": input_len, "output_len": output_len, "seconds": dt,
            "output_tokens_per_s": generated / dt, "total_tokens_per_s": (generated + num_requests * input_len) / dt,
            "requests_per_s": num_requests / dt}


def bench_prefill(engine: LLMEngine, batch: int, length: int, seed: int = 2) -> dict:
    prompts = _prompts(engine, batch, length, seed)
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    engine.generate(prompts[:1], params)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.generate(prompts, params)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return {"batch": batch, "length": length, "seconds": dt, "prefill_tokens_per_s": batch * length / dt}
