"""LoRA in rollouts: decode step time with adapters against the base model in one run, and an
adapter-only sync against a full-weight sync.

  python3 benchmarks/lora_bench.py [--layers 8] [--batches 1,8,64] [--ranks 16,64] [--adapters 8]
      [--context 512] [--steps 20] [--backend cuda_hopper_invariant] [--json OUT] [--smoke]

Per batch size B: the base engine's decode step (no adapter on any row; lora off), the same with
lora on and every row on the base model (the cost of carrying the stacks), then rows spread round
robin over ``--adapters`` adapters of each rank. Sync: one adapter's tensors copied into a slot
(``load_lora_adapter``, from device tensors) against ``update_weights`` of every parameter
(from device tensors). 35B-A3B shape at ``--layers`` depth, CUDA graphs on. ``--smoke``: a tiny
model on the CPU (the reference backend), a few steps: the script's path, not its figures."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from bi_core import EngineConfig, SamplingParams, build_engine
from bi_core.lora.synthetic import random_adapter


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def config(args, max_loras: int) -> EngineConfig:
    if args.smoke:
        model = {"random": {"preset": "tiny-moe", "seed": 0, "num_hidden_layers": 2}, "dtype": "float32",
                 "device": "cpu", "max_model_len": 256}
        rest = {"backend": "reference", "cache": {"block_size": 16, "num_blocks": 512}}
    else:
        model = {"random": {"preset": "qwen3.5-35b-a3b", "seed": 0, "num_hidden_layers": args.layers},
                 "dtype": "bfloat16", "device": "cuda", "max_model_len": args.context + 256}
        rest = {"backend": args.backend, "policy": {"batch_invariant": args.backend == "cuda_hopper_invariant"},
                "graph": {"enabled": True}}
    lora = {"max_loras": max_loras, "max_rank": max(args.ranks)} if max_loras else {}
    return EngineConfig.from_dict({"model": model, "scheduler": {"max_num_seqs": max(args.batches),
                                                                 "max_num_batched_tokens": 8192},
                                   "lora": lora, **rest})


def decode_ms(eng, batch: int, names: list[str | None], args) -> float:
    """Mean ms of ``args.steps`` engine steps once ``batch`` rows decode (row i on ``names[i % len]``)."""
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, eng.args.vocab_size, (batch, args.context), generator=g).tolist()
    budget = args.steps + 8 + batch
    seqs = [eng.add_request(p, SamplingParams(max_new_tokens=budget, ignore_eos=True, lora_name=names[i % len(names)]))
            for i, p in enumerate(prompts)]
    while any(not s.output_ids for s in seqs):
        eng.step()
    for _ in range(3):
        eng.step()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    sync()
    ms = (time.perf_counter() - t0) / args.steps * 1e3
    for s in seqs:
        eng.abort(s.request_id)
    return ms


def load_adapters(eng, args) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for r in args.ranks:
        for i in range(args.adapters):
            cfg, tensors = random_adapter(eng, r=r, seed=100 * r + i)
            eng.load_lora_adapter(f"r{r}_{i}", tensors=tensors, config=cfg)
            names.setdefault(r, []).append(f"r{r}_{i}")
    return names


def sync_times(eng, args) -> dict:
    """Seconds for one adapter pushed as a new version vs every weight updated, both from device tensors."""
    device = eng.device
    cfg, tensors = random_adapter(eng, r=max(args.ranks), seed=7)
    tensors = {k: v.to(device) for k, v in tensors.items()}
    full = {n: p.detach().clone() for n, p in eng.model.named_parameters()}
    out = {}
    for what, call in (("adapter", lambda: eng.load_lora_adapter("sync", tensors=tensors, config=cfg)),
                       ("full_weights", lambda: eng.update_weights(full))):
        call()  # warm
        sync()
        t0 = time.perf_counter()
        call()
        sync()
        out[f"{what}_s"] = time.perf_counter() - t0
    out["adapter_bytes"] = sum(t.numel() * t.element_size() for t in tensors.values())
    out["full_bytes"] = sum(t.numel() * t.element_size() for t in full.values())
    return out


def run(args) -> dict:
    report: dict = {"decode_ms": {}}
    base = build_engine(config(args, 0))
    for b in args.batches:
        report["decode_ms"][f"B={b} base (lora off)"] = decode_ms(base, b, [None], args)
    del base
    sync()
    max_loras = args.adapters * len(args.ranks) + 1  # + the sync's slot
    eng = build_engine(config(args, max_loras))
    names = load_adapters(eng, args)
    for b in args.batches:
        report["decode_ms"][f"B={b} lora on, no adapter"] = decode_ms(eng, b, [None], args)
        for r in args.ranks:
            report["decode_ms"][f"B={b} rank {r}, {args.adapters} adapters"] = decode_ms(eng, b, names[r], args)
    report["sync"] = sync_times(eng, args)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 64])
    p.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64])
    p.add_argument("--adapters", type=int, default=8, help="adapters of each rank")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--backend", default="cuda_hopper_invariant")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="a tiny CPU model: the script's path, not its figures")
    args = p.parse_args(argv)
    if args.smoke:
        args.batches, args.ranks, args.adapters, args.context, args.steps = [1, 2], [4, 8], 2, 24, 2
    report = run(args)
    for what, ms in report["decode_ms"].items():
        print(f"{what:<32} {ms:8.3f} ms/step", flush=True)
    s = report["sync"]
    print(f"sync: adapter {s['adapter_s'] * 1e3:.2f} ms ({s['adapter_bytes'] / 2**20:.1f} MiB), full weights "
          f"{s['full_weights_s'] * 1e3:.2f} ms ({s['full_bytes'] / 2**30:.2f} GiB)")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
