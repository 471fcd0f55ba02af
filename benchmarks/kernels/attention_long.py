"""Invariant decode attention at long contexts (issue 22): the split kernel and the ordered merge
timed apart, for split counts and the merge's loads in flight, against FlashInfer's tensor-core decode
(the default backend's kernel) on the same pages; every variant checked bitwise against the
first (neither the split count nor the merge's pipelining may change a bit). A first run
(dev/results/attention_long_h200_2026-11-23b.json) also tried merge programs of 64 or 32 of the
256 columns: slower than pipelining one program per head, so that variant is gone.

    python3 benchmarks/kernels/attention_long.py [--contexts 32000,131000] [--batches 1,4,8,32] [--repeats 5]
                                         [--merge-run N] [--split-warps W]
                                         [--splits 64,128,256 --split-stages 2,3] [--merge-warps 4,2,1]
                                         [--sched "splits=wave;splits=wave,run_programs=528;..."]

Each variant is also called ``--repeats`` more times, each call's output compared with the one
before (``repeat_elements_differing`` must be 0: a race between the kernels would show there).

Qwen3.5-35B-A3B's attention layer: 16 query heads, 2 KV heads, head dim 256, pages of 16."""

from __future__ import annotations

import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

import bi_core.kernels.attention as attn

HQ, HKV, D, PAGE = 16, 2, 256, 16
REPEATS = 5


def kernel_times(fn, reps: int = 20) -> dict[str, float]:
    """Mean µs per call of each kernel ``fn`` launches (torch profiler)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_time_total > 0 and not e.key.startswith(("Memcpy", "Memset")):
            out[e.key] = e.device_time_total / reps
    return out


def timed_and_repeated(run, out: torch.Tensor) -> tuple[dict[str, float], int]:
    """``run``'s kernel times, then REPEATS more calls, each call's ``out`` compared with the one
    before: (times, elements differing; a race between the kernels would show there). Each repeat
    gets a fresh workspace from the allocator, as the engine's steps do."""
    times = kernel_times(run)
    differing = 0
    for _ in range(REPEATS):
        last = out.clone()
        run()
        differing += int((out != last).sum())
    return times, differing


def shipped_splits(batch: int, context: int) -> int:
    """Split programs per (sequence, KV head) as the backend plans them (equal contexts)."""
    from bi_core.backends.cuda_common.attention import CHUNKS_PER_PROGRAM, PROGRAMS_WANTED

    splits = max(-(-PROGRAMS_WANTED // (batch * HKV)), -(-context // (attn.KV_SPLIT * CHUNKS_PER_PROGRAM)))
    return max(1, min(-(-context // attn.KV_SPLIT), splits))


def sched_case(v: dict, batch, context, q, kc, vc, gate, bt, ctx, cu, dec, chunks, ref) -> dict:
    """One ``--sched`` variant: the shipped kernels with the scheduling knobs ``v`` set."""
    names = {"run_programs": "RUN_PROGRAMS", "run_stages": "RUN_STAGES"}
    saved = {n: getattr(attn, n) for n in names.values()}
    splits = shipped_splits(batch, context) if v.get("splits", "wave") == "wave" else \
        max(1, min(-(-context // attn.KV_SPLIT), int(v["splits"])))
    try:
        for k, n in names.items():
            if k in v:
                setattr(attn, n, int(v[k]))
        out = torch.full((batch, HQ * D), float("nan"), device="cuda", dtype=torch.bfloat16)

        def run():
            attn.decode_attention(q, kc, vc, gate, out, bt, ctx, cu, dec, D**-0.5, 1, splits, chunks)

        times, differing = timed_and_repeated(run, out)
        return {"batch": batch, "context": context, "sched": v, "splits": splits,
                "split_us": sum(t for k, t in times.items() if "split" in k),
                "run_merge_us": sum(t for k, t in times.items() if "merge_runs" in k),
                "merge_us": sum(t for k, t in times.items() if "merge" in k and "merge_runs" not in k),
                "total_us": sum(t for k, t in times.items() if "split" in k or "merge" in k),
                "bitwise_same_as_first": None if ref is None else torch.equal(out, ref),
                "repeat_elements_differing": differing, "all_written": not bool(out.isnan().any()), "out": out}
    finally:
        for n, val in saved.items():
            setattr(attn, n, val)


def case(batch: int, context: int, variants, flashinfer) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(batch * 7 + context)
    pages = -(-context // PAGE)
    kc = torch.randn(batch * pages, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(kc.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    gate = torch.randn(batch, 2 * HQ * D, device="cuda", dtype=torch.bfloat16, generator=g)
    bt = torch.arange(batch * pages, dtype=torch.int32, device="cuda").view(batch, pages)
    ctx = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    dec = torch.arange(batch, dtype=torch.int64, device="cuda")
    chunks = batch * -(-context // attn.KV_SPLIT)
    rows, ref = [], None
    shipped = attn.MERGE_WARPS
    for v in variants(batch, context):
        if isinstance(v, dict):
            rows.append(sched_case(v, batch, context, q, kc, vc, gate, bt, ctx, cu, dec, chunks, ref))
            ref = rows[0]["out"] if ref is None else ref
            continue
        splits, stages, warps, split_stages, *merge_warps = v
        attn.MERGE_STAGES, attn.MERGE_PIPELINED_PROGRAMS = stages, 1 << 30
        attn.DECODE_WARPS, attn.DECODE_STAGES = warps, split_stages
        attn.MERGE_WARPS = merge_warps[0] if merge_warps else shipped
        out = torch.full((batch, HQ * D), float("nan"), device="cuda", dtype=torch.bfloat16)

        def run(out=out, splits=splits):
            attn.decode_attention(q, kc, vc, gate, out, bt, ctx, cu, dec, D**-0.5, 1, splits, chunks)

        # every call must give the first call's bits (a race would not show in one comparison)
        times, differing = timed_and_repeated(run, out)
        split_us = sum(v for k, v in times.items() if "split" in k)
        merge_us = sum(v for k, v in times.items() if "merge" in k)
        same = None
        if ref is None:
            ref = out.clone()
        else:
            same = torch.equal(out, ref)
        rows.append({"batch": batch, "context": context, "splits": splits, "merge_stages": stages,
                     "split_warps": warps, "split_stages": split_stages, "merge_warps": attn.MERGE_WARPS,
                     "split_us": split_us, "merge_us": merge_us, "total_us": split_us + merge_us,
                     "bitwise_same_as_first": same, "repeat_elements_differing": differing,
                     "all_written": not bool(out.isnan().any())})
    attn.MERGE_WARPS = shipped
    for r in rows:
        r.pop("out", None)
    if flashinfer is not None:
        ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
        indptr = torch.arange(0, (batch + 1) * pages, pages, dtype=torch.int32, device="cuda")
        last = torch.full((batch,), context - (pages - 1) * PAGE, dtype=torch.int32, device="cuda")
        w.plan(indptr, bt.flatten(), last, HQ, HKV, D, PAGE, q_data_type=torch.bfloat16)
        times = kernel_times(lambda: w.run(q, (kc, vc)))
        rows.append({"batch": batch, "context": context, "flashinfer_us": sum(times.values())})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="32000,131000")
    ap.add_argument("--batches", default="1,4,8,32,64")
    ap.add_argument("--json")
    ap.add_argument("--sweep-split", action="store_true", help="sweep the split kernel's warps and stages")
    ap.add_argument("--merge-run", type=int, help="override kernels.attention.MERGE_RUN (1 << 30: one-level merge)")
    ap.add_argument("--split-warps", type=int, help="override the split kernel's warps (default: as shipped)")
    ap.add_argument("--repeats", type=int, default=REPEATS, help="calls per variant checked against the previous one")
    ap.add_argument("--splits", help="split programs per (sequence, KV head) to try, e.g. 64,128,256 or wave (as planned; with "
                    "--split-stages: every pair; merge as shipped)")
    ap.add_argument("--split-stages", default="2", help="the split kernel's pipeline stages to try with --splits")
    ap.add_argument("--merge-warps", help="the merges' warps to try, e.g. 4,2,1 (the rest as shipped)")
    ap.add_argument("--sched", help="scheduling knobs to try, as shipped otherwise: ';'-separated variants of "
                    "'splits=N,run_programs=N,run_stages=N' (splits=wave: PROGRAMS_WANTED)")
    a = ap.parse_args()
    globals()["REPEATS"] = a.repeats
    if a.merge_run:
        attn.MERGE_RUN = a.merge_run
    warps = a.split_warps or attn.DECODE_WARPS  # the shipped split kernel's warps unless overridden
    try:
        import flashinfer
    except ImportError:
        flashinfer = None

    def variants(batch, context):
        chunks = -(-context // attn.KV_SPLIT)
        if a.sched:  # scheduling only: every variant must give the first's bits
            return [dict(kv.split("=") for kv in v.split(",") if kv) for v in a.sched.split(";")]
        old = max(1, min(64, max(-(-264 // (batch * HKV)), -(-context // (attn.KV_SPLIT * 4)))))  # section 13's plan
        new = shipped_splits(batch, context)
        if a.merge_warps:  # scheduling only: the merges' arithmetic is elementwise
            return [(new, 6, warps, 2, int(w)) for w in a.merge_warps.split(",")]
        if a.splits:  # scheduling only: every pair must give the first's bits
            return [(new if sp == "wave" else min(chunks, int(sp)), 6, warps, int(st)) for sp in a.splits.split(",")
                    for st in a.split_stages.split(",")]
        if a.sweep_split:  # the split kernel's warps and pipeline stages, merge as shipped
            return [(new, 6, w, st) for w, st in ((4, 2), (4, 3), (4, 4), (8, 2), (8, 3), (2, 2), (2, 3))]
        return [(old, 1, warps, 2), (new, 1, warps, 2), (new, 3, warps, 2), (new, 6, warps, 2)]

    rows = []
    for context in (int(c) for c in a.contexts.split(",")):
        for batch in (int(b) for b in a.batches.split(",")):
            for r in case(batch, context, variants, flashinfer):
                rows.append(r)
                print(json.dumps(r), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
