"""FP8 against bf16 on the same weights (issue 25's accuracy report): a random preset drawn once
per engine from the same seed. The bf16 engine (bf16 weights, bf16 KV cache) writes greedy
continuations; the FP8 engine scores them exactly (mean and max |logprob difference| per token),
then writes its own greedy continuations (how many positions agree, and how long the common
prefix runs). ``--fp8`` says what the FP8 engine quantizes: ``weights`` (block-wise on load,
``model.quantization: fp8``), ``kv`` (the KV cache, ``cache.kv_cache_dtype: fp8``) or ``both``.

  python3 benchmarks/fp8_accuracy.py CONFIG [--fp8 weights|kv|both] [--num-layers N] [--prompts 32]
      [--prompt-len 256] [--new-tokens 128]

CONFIG: a bf16 config (``model.quantization`` unset); one engine is built at a time."""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

import attrs
import torch

from bi_core import EngineConfig, SamplingParams, build_engine


def free(engine) -> None:
    engine.close()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--num-layers", type=int)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--fp8", choices=("weights", "kv", "both"), default="weights")
    args = ap.parse_args()
    cfg = EngineConfig.from_yaml(args.config)
    if cfg.model.quantization not in (None, "none") or cfg.cache.kv_cache_dtype != "auto":
        raise SystemExit(f"{args.config}: model.quantization is {cfg.model.quantization!r}, cache.kv_cache_dtype "
                         f"{cfg.cache.kv_cache_dtype!r}; give the bf16 config")
    if args.num_layers:
        cfg = cfg.replace(model={"random": attrs.evolve(cfg.model.random, num_hidden_layers=args.num_layers)})
    greedy = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)

    t0 = time.perf_counter()
    bf16 = build_engine(cfg)
    rng = random.Random(0)
    prompts = [[rng.randrange(bf16.args.vocab_size) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    ref = bf16.generate(prompts, greedy)
    free(bf16)
    fp8 = build_engine(cfg.replace(
        **({} if args.fp8 == "kv" else {"model": {"quantization": "fp8"}}),
        **({} if args.fp8 == "weights" else {"cache": {"kv_cache_dtype": "fp8"}})))
    scored = fp8.score(prompts, [o.token_ids for o in ref])
    own = fp8.generate(prompts, greedy)
    free(fp8)

    diffs = [abs(a - b) for s, r in zip(scored, ref) for a, b in zip(s.token_logprobs, r.token_logprobs)]
    same = sum(a == b for o, r in zip(own, ref) for a, b in zip(o.token_ids, r.token_ids))
    prefixes = [next((i for i, (a, b) in enumerate(zip(o.token_ids, r.token_ids)) if a != b), len(r.token_ids))
                for o, r in zip(own, ref)]
    total = sum(len(r.token_ids) for r in ref)
    label = cfg.model.random.preset if cfg.model.random else cfg.model.path
    print(f"{label}, {bf16_layers(cfg)} layers, backend {cfg.backend}, FP8 {args.fp8}; {args.prompts} prompts x "
          f"{args.prompt_len} "
          f"tokens -> {args.new_tokens} greedy tokens ({time.perf_counter() - t0:.0f} s)")
    print(f"  FP8 scoring bf16's tokens: |logprob difference| mean {statistics.fmean(diffs):.4f}, "
          f"median {statistics.median(diffs):.4f}, max {max(diffs):.4f} over {len(diffs)} tokens")
    print(f"  FP8 greedy vs bf16 greedy: {same}/{total} positions agree ({same / total:.1%}); common prefix "
          f"median {statistics.median(prefixes):.0f}, min {min(prefixes)}, {sum(p == args.new_tokens for p in prefixes)}"
          f"/{len(prefixes)} prompts agree throughout")


def bf16_layers(cfg: EngineConfig) -> str:
    r = cfg.model.random
    return str(r.num_hidden_layers) if r is not None and r.num_hidden_layers else "all"


if __name__ == "__main__":
    main()
