"""``bi-engine bench``: runs each config in turn in one process (same GPU, same session), plus an
optional transformers baseline, and prints one table with ratios against the first config."""

from __future__ import annotations

import datetime
import json
import time

import torch

from bi_core.config import EngineConfig
from bi_core.errors import BiEngineError
from bi_core.runtime import gc_heap
from bi_core.tools.bench import (
    bench_decode,
    bench_prefill,
    bench_throughput,
    host_bound_note,
    measure_bandwidth,
    measure_matmul_flops,
)
from bi_core.tools.flags import positive_ints
from bi_core.tools.host_probe import describe


def _label(cfg: EngineConfig) -> str:
    """What a run measured; ``backend: auto`` is shown as the backend it resolves to here."""
    model = cfg.model.random.preset if cfg.model.random else cfg.model.path
    layers = f"/{cfg.model.random.num_hidden_layers}L" if cfg.model.random and cfg.model.random.num_hidden_layers else ""
    mode = "invariant" if cfg.policy.batch_invariant else "default"
    extras = f" quantization={cfg.model.quantization}" if cfg.model.quantization not in (None, "none") else ""
    extras += "".join(f" {op}={','.join(b)}" for op, b in cfg.policy.ops.items())
    extras += f" kv={cfg.cache.kv_cache_dtype}" if cfg.cache.kv_cache_dtype != "auto" else ""
    extras += f" state={cfg.cache.ssm_state_dtype}" if cfg.cache.ssm_state_dtype != "float32" else ""
    extras += f" strategy={cfg.strategy.name}" if cfg.strategy.name != "ar" else ""
    extras += f" tp={cfg.parallel.tensor_parallel_size}" if cfg.parallel.tensor_parallel_size > 1 else ""
    return f"{model}{layers} {_backend(cfg)} {mode} graphs={'on' if cfg.graph.enabled else 'off'}{extras}"


def _backend(cfg: EngineConfig) -> str:
    from bi_core.policies import planned_device
    from bi_core.policies.base import auto_backend

    if cfg.backend != "auto":
        return cfg.backend
    return auto_backend(batch_invariant=cfg.policy.batch_invariant, device=planned_device(cfg.model.device))


def _triple(text: str, flag: str, n: int) -> list[int] | None:
    if text == "none":
        return None
    try:
        parts = [int(x) for x in text.lower().split("x")]
    except ValueError:
        parts = []
    if len(parts) != n:
        raise BiEngineError(f"{flag}: expected {'x'.join(['N'] * n)} or 'none', got {text!r}")
    return parts


def check_bench_args(args) -> None:
    """Every flag's value, before a GPU is looked for or an engine built: one error naming the flag."""
    positive_ints(args.batch_sizes, "--batch-sizes")
    positive_ints(args.context_len, "--context-len")
    if args.steps < 1:
        raise BiEngineError(f"--steps: expected a positive integer, got {args.steps}")
    for text, flag, n in ((args.throughput, "--throughput", 3), (args.prefill, "--prefill", 2)):
        parts = _triple(text, flag, n)
        if parts is not None and min(parts) < 1:
            raise BiEngineError(f"{flag}: every part must be positive, got {text!r}")


def _free() -> None:
    gc_heap.collect()  # the engine's start was frozen out of the GC (runtime/gc_heap.py)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def bench_engine(cfg: EngineConfig, args, bandwidth: float, matmul_flops: float) -> dict:
    from bi_core import build_engine

    batch_sizes = positive_ints(args.batch_sizes, "--batch-sizes")
    tput = _triple(args.throughput, "--throughput", 3)
    pre = _triple(args.prefill, "--prefill", 2)
    t0 = time.perf_counter()
    engine = build_engine(cfg)
    out: dict = {"label": _label(cfg), "backend": engine.policy.backend, "invariant": cfg.policy.batch_invariant,
                 "graphs": cfg.graph.enabled, "decode": [], "startup_s": time.perf_counter() - t0}
    print(f"  engine start {out['startup_s']:.1f} s" + (f" ({engine.warmup})" if engine.warmup else ""), flush=True)
    cache = engine.cache
    out["weights_gib"] = sum(p.numel() * p.element_size() for p in engine.model.parameters()) / 2**30
    out["kv_cache_tokens"] = cache.num_blocks * cache.block_size
    out["memory_after_start_gib"] = torch.cuda.memory_allocated() / 2**30
    print(f"  weights {out['weights_gib']:.1f} GiB, KV cache {out['kv_cache_tokens']:,} tokens, GDN states for "
          f"{cache.num_slots} sequences, {out['memory_after_start_gib']:.1f} GiB allocated after start"
          f" (GPU total {torch.cuda.get_device_properties(engine.device).total_memory / 2**30:.1f} GiB)", flush=True)
    contexts = positive_ints(args.context_len, "--context-len")
    for b, context in ((b, c) for c in contexts for b in batch_sizes):
        r = bench_decode(engine, b, context, args.steps, bandwidth)
        layers = engine.args.num_hidden_layers
        out["decode"].append({"batch": b, "context_len": r.context_len, "ms_per_step": r.ms_per_step,
                              "tokens_per_s": r.tokens_per_s, "floor_ms": r.floor_ms, "over_floor": r.over_floor,
                              "kernels_per_step": r.kernels_per_step, "kernel_ms": r.kernel_ms})
        kernels = (f"  {r.kernels_per_step} kernels/step ({r.kernels_per_step / layers:.1f}/layer)"
                   if r.kernels_per_step else "") + host_bound_note(r.ms_per_step, r.kernel_ms)
        print(f"  decode B={b:<4} ctx {context:<5} {r.ms_per_step:8.3f} ms/step  floor {r.floor_ms:7.3f} ms  x{r.over_floor:5.2f}  "
              f"{r.tokens_per_s:9.1f} tok/s{kernels}", flush=True)
    if tput:
        out["throughput"] = bench_throughput(engine, *tput)
        print(f"  throughput {tput[0]} req x {tput[1]} in / {tput[2]} out: "
              f"{out['throughput']['output_tokens_per_s']:.1f} output tok/s, "
              f"{out['throughput']['requests_per_s']:.2f} req/s" +
              (f", draft acceptance {out['throughput']['draft_acceptance']:.2f}"
               if "draft_acceptance" in out["throughput"] else ""), flush=True)
    if pre:
        out["prefill"] = r = bench_prefill(engine, *pre, matmul_flops)
        ttft = f", time to first token {r['ttft_ms']:.1f} ms" if "ttft_ms" in r else ""
        cache = "prefix cache on, 0 tokens cached" if r["prefix_cache"] else "prefix cache off"
        spread = "/".join(f"{t * 1e3:.0f}" for t in r["pass_seconds"])
        kernel_ms = r["kernel_seconds"] * 1e3 if r["kernel_seconds"] is not None else None
        if kernel_ms is not None:  # a pass well over its kernels' time waited for the host
            spread += f", a pass's kernels {kernel_ms:.0f}"
        print(f"  prefill {pre[0]} x {pre[1]}: {r['prefill_tokens_per_s']:.0f} tok/s{ttft}  floor "
              f"{r['floor_s'] * 1e3:.1f} ms  x{r['over_floor']:.2f}  (median of passes {spread} ms; fresh prompts, "
              f"{cache}){host_bound_note(r['seconds'] * 1e3, kernel_ms)}", flush=True)
        print(f"    host, a pass: {describe(r['host'])}", flush=True)
    out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    out["tensor_parallel_size"] = cfg.parallel.tensor_parallel_size
    engine.close()  # tensor parallel: stop the other ranks before the next config starts its own
    del engine
    _free()
    return out


def bench_transformers(cfg: EngineConfig, batch_sizes=(1, 16), prompt_len: int = 64, new_tokens: int = 32) -> dict:
    """transformers' own generate on the same model shape (random weights drawn by transformers,
    since two copies of a large model do not fit together), greedy, bf16, on the GPU."""
    from transformers import AutoModelForCausalLM, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    from bi_core.runtime.build import resolve_model

    args, _ = resolve_model(cfg)
    if cfg.model.path:
        model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.bfloat16, device_map="cuda")
    else:
        fields = {k: v for k, v in args.to_hf_text_config().items() if k != "model_type"}
        cls, conf = (Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig) if args.is_moe else (Qwen3_5ForCausalLM, Qwen3_5TextConfig)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("cuda"):
                model = cls(conf(**fields))
        finally:
            torch.set_default_dtype(previous)
    model.eval()
    out = {}
    g = torch.Generator().manual_seed(0)
    for b in batch_sizes:
        ids = torch.randint(0, args.vocab_size, (b, prompt_len), generator=g).cuda()
        kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, use_cache=True)
        model.generate(ids, **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, **kwargs)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        out[b] = {"tokens_per_s": b * new_tokens / dt, "seconds": dt}
        print(f"  transformers generate B={b:<3} {b * new_tokens / dt:8.1f} tok/s ({new_tokens} new tokens, "
              f"prompt {prompt_len})", flush=True)
    del model
    _free()
    return out


def print_comparisons(results: list[dict]) -> None:
    """Every config's figures against the first's: decode step time, throughput, and the prefill's
    median pass time beside its device time (a pass's wall time also moves with the host's pace:
    dev/benchmarks-history.md)."""
    base = results[0]
    for other in results[1:]:
        print(f"== {other['label']} vs {base['label']}")
        for a, b in zip(other["decode"], base["decode"]):
            print(f"  decode B={a['batch']:<4} ctx {a['context_len']:<5} {a['ms_per_step'] / b['ms_per_step']:.3f}x time")
        if "throughput" in other and "throughput" in base:
            ratio = base["throughput"]["seconds"] / other["throughput"]["seconds"]
            print(f"  throughput {ratio:.3f}x")
        a, b = other.get("prefill"), base.get("prefill")
        if a and b and (a["batch"], a["length"]) == (b["batch"], b["length"]):
            device = (f", {a['kernel_seconds'] / b['kernel_seconds']:.3f}x device time"
                      if a.get("kernel_seconds") and b.get("kernel_seconds") else "")
            print(f"  prefill {a['batch']} x {a['length']} {a['seconds'] / b['seconds']:.3f}x time (median pass){device}")


def run_bench(args, configs: list[EngineConfig]) -> int:
    check_bench_args(args)
    if not torch.cuda.is_available():
        raise BiEngineError("bench needs a CUDA GPU (it measures against the device's memory bandwidth)")
    device = torch.device("cuda")
    bandwidth, matmul_flops = measure_bandwidth(device), measure_matmul_flops(device)
    report = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(device),
              "bandwidth_tb_s": bandwidth / 1e12, "matmul_tflops": matmul_flops / 1e12, "configs": []}
    print(f"{report['gpu']}, memory {bandwidth / 1e12:.2f} TB/s (the faster of copy and read), bf16 matmul "
          f"{matmul_flops / 1e12:.0f} TFLOP/s: the floors below")
    for cfg in configs:
        print(f"== {_label(cfg)}", flush=True)
        report["configs"].append(bench_engine(cfg, args, bandwidth, matmul_flops))
    if args.transformers:
        print("== transformers baseline", flush=True)
        report["transformers"] = bench_transformers(configs[0])
    print_comparisons(report["configs"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0
