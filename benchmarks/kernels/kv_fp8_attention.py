"""The invariant decode attention over an FP8 KV cache against a bf16 one (issue 25's FP8 KV
cache), kernels alone: the same keys and values (the bf16 cache holds the FP8 cache's exact
values), the shipped split count, at long contexts. Variants per (context, batch):

- ``bf16``: the bf16 cache (the reference time);
- ``fp8_bf16dot``: the FP8 cache, values converted to bf16 (``FP8_KV_F16 = False``);
- ``fp8_f16dot``: the FP8 cache, q and the values in float16 (``FP8_KV_F16 = True``, shipped);
- ``fp8_f16dot_w4``: as the last with 4 warps in the split kernel.

Each row: split kernel and merge times (torch profiler, mean of 20 calls), the split kernel's KV
bytes per µs, whether repeated calls keep their bits, whether it has the bits of its neighbour
(``fp8_bf16dot`` vs ``bf16``: the same values and dot dtype; ``_w4`` vs 2 warps), and the largest
difference from the bf16 cache's output (the same values: what the dots' dtype costs). On an H200
(benchmarks section 34) neither pair was bitwise equal everywhere: the compiled dots differ with
the load's element type and with the warps (the FP8 path's arithmetic is fixed per cache dtype and
warps, never per batch; the warps are a constant).

``--fp8-tiles 64x2,64x3`` adds FP8 (f16 dots) variants with other keys per block (BLOCK_N: part of
the arithmetic, so a candidate constant for FP8 caches only) and pipeline stages.

    python3 benchmarks/kernels/kv_fp8_attention.py [--contexts 32000,131000] [--batches 1,8,32] [--json F]
        [--fp8-tiles 64x2,64x3] [--shuffle-pages]

``--shuffle-pages`` lays each sequence's pages out in a random order: an engine's pages come from a
free list, and chunked prefills of several prompts interleave them. A page of an FP8 cache is half
the bytes of a bf16 one, so scattered pages may cost it more (the open question of section 34:
the split kernel is 0.88x the bf16 cache's here, the engine step at 131k is not faster)."""

from __future__ import annotations

import argparse
import json

import torch
from attention_long import HKV, HQ, PAGE, D, shipped_splits, timed_and_repeated

import bi_core.kernels.attention as attn


def run_variant(name, batch, context, q, kc, vc, gate, bt, ctx, cu, dec, chunks, **knobs):
    """One variant: ``knobs`` set module constants of kernels/attention.py for its calls."""
    saved = {k: getattr(attn, k) for k in knobs}
    for k, v in knobs.items():
        setattr(attn, k, v)
    try:
        splits = shipped_splits(batch, context)
        out = torch.full((batch, HQ * D), float("nan"), device="cuda", dtype=torch.bfloat16)

        def run():
            attn.decode_attention(q, kc, vc, gate, out, bt, ctx, cu, dec, D**-0.5, 1, splits, chunks)

        times, differing = timed_and_repeated(run, out)
    finally:
        for k, v in saved.items():
            setattr(attn, k, v)
    split_us = sum(t for k, t in times.items() if "split" in k)
    kv_bytes = 2 * batch * context * HKV * D * kc.element_size()
    return {"variant": name, "batch": batch, "context": context, "splits": splits, "split_us": split_us,
            "merge_us": sum(t for k, t in times.items() if "merge" in k),
            "kv_GB_per_s": kv_bytes / split_us / 1e3, "repeat_elements_differing": differing,
            "all_written": not bool(out.isnan().any()), "out": out}


def case(batch: int, context: int, fp8_tiles: list[tuple[int, int]], shuffle: bool) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(batch * 7 + context)
    pages = -(-context // PAGE)
    # keys and values of attention's usual size, e4m3's exact values in both caches
    kc8 = torch.randn(batch * pages, PAGE, HKV, D, device="cuda", generator=g).to(torch.float8_e4m3fn)
    vc8 = torch.randn(kc8.shape, device="cuda", generator=g).to(torch.float8_e4m3fn)
    kc, vc = kc8.to(torch.bfloat16), vc8.to(torch.bfloat16)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    gate = torch.randn(batch, 2 * HQ * D, device="cuda", dtype=torch.bfloat16, generator=g)
    bt = torch.arange(batch * pages, dtype=torch.int32, device="cuda").view(batch, pages)
    if shuffle:  # pages scattered over the cache, as an engine's chunked prefills of several prompts leave them
        bt = torch.randperm(batch * pages, generator=g, device="cuda").to(torch.int32).view(batch, pages)
    ctx = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    dec = torch.arange(batch, dtype=torch.int64, device="cuda")
    chunks = batch * -(-context // attn.KV_SPLIT)
    common = (batch, context, q)
    rows = [run_variant("bf16", *common, kc, vc, gate, bt, ctx, cu, dec, chunks),
            run_variant("fp8_bf16dot", *common, kc8, vc8, gate, bt, ctx, cu, dec, chunks, FP8_KV_F16=False),
            run_variant("fp8_f16dot", *common, kc8, vc8, gate, bt, ctx, cu, dec, chunks, FP8_KV_F16=True),
            run_variant("fp8_f16dot_w4", *common, kc8, vc8, gate, bt, ctx, cu, dec, chunks, FP8_KV_F16=True,
                        DECODE_WARPS=4)]
    for block_n, stages in fp8_tiles:  # --fp8-tiles: keys per block (part of the arithmetic) and stages
        rows.append(run_variant(f"fp8_f16_n{block_n}s{stages}", *common, kc8, vc8, gate, bt, ctx, cu, dec, chunks,
                                FP8_KV_F16=True, BLOCK_N=block_n, DECODE_STAGES=stages))
    by = {r["variant"]: r["out"] for r in rows}
    neighbour = {"fp8_bf16dot": "bf16", "fp8_f16dot_w4": "fp8_f16dot"}
    for r in rows:
        other = neighbour.get(r["variant"])
        r["bitwise_equal_to"] = None if other is None else f"{other}: {torch.equal(r['out'], by[other])}"
        r["max_abs_diff_vs_bf16"] = float((r["out"].float() - by["bf16"].float()).abs().max())
    for r in rows:
        del r["out"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="32000,131000")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--json")
    ap.add_argument("--fp8-tiles", default="", help="extra FP8 variants BLOCK_NxSTAGES, e.g. 64x2,64x3,32x4")
    ap.add_argument("--shuffle-pages", action="store_true", help="block tables in a random page order")
    args = ap.parse_args()
    fp8_tiles = [tuple(map(int, t.split("x"))) for t in args.fp8_tiles.split(",") if t]
    results = []
    print(f"{'context':>8} {'B':>3} {'variant':<17} {'splits':>6} {'split µs':>9} {'merge µs':>9} {'KV GB/s':>8} "
          f"{'repeats':>7}  equal to / max |diff| vs bf16")
    for context in map(int, args.contexts.split(",")):
        for batch in map(int, args.batches.split(",")):
            for r in case(batch, context, fp8_tiles, args.shuffle_pages):
                results.append(r)
                print(f"{context:>8} {batch:>3} {r['variant']:<17} {r['splits']:>6} {r['split_us']:>9.1f} "
                      f"{r['merge_us']:>9.1f} {r['kv_GB_per_s']:>8.0f} {r['repeat_elements_differing']:>7}  "
                      f"{r['bitwise_equal_to'] or '-'} / {r['max_abs_diff_vs_bf16']:.2e}", flush=True)
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
