"""Prompt-row attention (issue 22): the invariant backend's prompt kernel against FlashInfer's
prefill (the default backend's) on the same pages, the whole gated attention op each (q/k norm,
RoPE, KV write, attention, output gate), Qwen3.5-35B-A3B's layer: 16 query heads, 2 KV heads,
head dim 256, pages of 16.

    python3 benchmarks/kernels/prefill_attention_bench.py [--sweep] [--json PATH]

Cases: a 976-token chunk 20,000 tokens into a prompt (the mixed-load step of section 14), 4 x
2,048 fresh tokens (an 8,192-token prefill step), a 2,048-token chunk at 30,000 and at 120,000.
Variants: the prompt kernel at the tree's config, and with --sweep its tile configs (the fold
kernel that prompt tiles ran before, timed against these in section 17's run, is gone from the
tree). Every variant is checked on the GPU: close to
FlashInfer's output (bf16 tolerance), and invariant (the 976-token chunk's rows bitwise the same
alone, beside a decode row and another prompt chunk, and as the tail of the prompt computed in one
longer chunk)."""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import torch

import bi_core.kernels.attention as attn
from bi_core.backends.cuda_common.attention import FlashInferAttentionImpl, TritonPagedAttentionImpl
from bi_core.ops.attention import AttentionSpec
from bi_core.runtime.batch import build_context

HQ, HKV, D, PAGE = 16, 2, 256, 16
WIDTH = 2 * HQ * D + 2 * HKV * D
CASES = {"976 @ 20k": ([976], [20000]), "4 x 2048 @ 0": ([2048] * 4, [0] * 4),
         "2048 @ 30k": ([2048], [30000]), "2048 @ 120k": ([2048], [120000])}


def spec() -> AttentionSpec:
    return AttentionSpec(dtype=torch.bfloat16, device=torch.device("cuda"), num_heads=HQ, num_kv_heads=HKV,
                         head_dim=D, scale=D**-0.5, rotary_dim=64, rope_theta=1e7, norm_eps=1e-6)


def context(qlens, plens, recurrent=None):
    blocks, nxt = [], 0
    for q, p in zip(qlens, plens):
        n = -(-(q + p) // PAGE)
        blocks.append(list(range(nxt, nxt + n)))
        nxt += n
    recurrent = recurrent or [False] * len(qlens)
    _, ctx = build_context([[0] * q for q in qlens], plens, blocks, list(range(len(qlens))), recurrent,
                           block_size=PAGE, device=torch.device("cuda"))
    return ctx, nxt


def timed(fn, reps: int = 10) -> float:
    """µs per call (CUDA events over ``reps`` calls after one warm call)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps


def make_impl(config: dict | None):
    """An invariant attention impl whose prompt kernel runs ``config`` (None: the tree's)."""
    for k, name in (("M_ROWS", "PREFILL_M_ROWS"), ("BLOCK_N", "PREFILL_BLOCK_N"), ("num_warps", "PREFILL_WARPS"),
                    ("num_stages", "PREFILL_STAGES")):
        setattr(attn, name, (config or {}).get(k, DEFAULTS[name]))
    return TritonPagedAttentionImpl(spec())


DEFAULTS = {n: getattr(attn, n, None) for n in ("PREFILL_M_ROWS", "PREFILL_BLOCK_N", "PREFILL_WARPS", "PREFILL_STAGES")}


def invariance(impl, norms, kc, vc, qkv) -> str:
    """The 976-token chunk at 20k: alone vs beside a decode row and a 300-token prompt chunk, and
    vs the tail of the prompt's last 1,500 tokens computed as one chunk: bitwise."""
    def run(qlens, plens, rows, recurrent=None):
        ctx, _ = context(qlens, plens, recurrent)
        return impl.forward(rows, *norms, kc, vc, ctx)

    alone = run([976], [20000], qkv[524:1500])
    bad = []
    if not torch.equal(run([976, 1, 300], [20000, 5000, 100], torch.cat([qkv[524:1500], qkv[:301]]),
                           [False, True, False])[:976], alone):
        bad.append("batched")
    longer = run([1500], [19476], qkv[:1500])
    again = run([976], [20000], qkv[524:1500])  # on the keys the longer chunk wrote at 19,476..19,999
    if not torch.equal(longer[524:], again):
        bad.append("chunking")
    return ",".join(bad) or "ok"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="the prompt kernel's tile configs")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(0)
    caches = {}  # one KV cache per case (every run rewrites its own new tokens' keys with the same values)
    for name, (qlens, plens) in [*CASES.items(), ("invariance", ([1500, 1, 300], [20000, 5000, 100]))]:
        pages = -(-(sum(qlens) + sum(plens)) // PAGE) + 8
        kc = torch.randn(pages, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16)
        caches[name] = (kc, torch.randn_like(kc))
    norms = [0.1 * torch.randn(D, device="cuda", dtype=torch.bfloat16) + 1 for _ in range(2)]
    qkv = torch.randn(8192, WIDTH, device="cuda", dtype=torch.bfloat16)
    fi = FlashInferAttentionImpl(spec())
    variants: list[tuple[str, dict | None]] = [("tree", None)]
    grid = [(128, 64, 8, 3), (128, 32, 8, 3), (128, 32, 8, 4), (128, 64, 8, 2), (64, 32, 4, 3), (64, 32, 4, 4),
            (64, 64, 4, 2), (128, 32, 4, 3)]
    if args.sweep:
        variants += [(f"M{m} N{n} w{w} s{st}", {"M_ROWS": m, "BLOCK_N": n, "num_warps": w, "num_stages": st})
                     for m, n, w, st in grid]
    results = []
    ref = {}
    print(f"{'variant':<18}" + "".join(f"{c:>16}" for c in CASES) + "  vs FlashInfer (max rel err), invariance")
    row = f"{'FlashInfer':<18}"
    for name, (qlens, plens) in CASES.items():
        ctx, _ = context(qlens, plens)
        rows = qkv[: sum(qlens)]
        ref[name] = fi.forward(rows, *norms, *caches[name], ctx).float()
        t = timed(functools.partial(fi.forward, rows, *norms, *caches[name], ctx))
        results.append({"variant": "FlashInfer", "case": name, "us": t})
        row += f"{t:>14.0f}us"
    print(row, flush=True)
    for vname, cfg in variants:
        t0 = time.perf_counter()
        try:
            impl = make_impl(cfg)
            row, err = f"{vname:<18}", 0.0
            for name, (qlens, plens) in CASES.items():
                ctx, _ = context(qlens, plens)
                rows = qkv[: sum(qlens)]
                out = impl.forward(rows, *norms, *caches[name], ctx).float()
                err = max(err, ((out - ref[name]).abs().max() / ref[name].abs().max()).item())
                t = timed(functools.partial(impl.forward, rows, *norms, *caches[name], ctx))
                results.append({"variant": vname, "case": name, "us": t, "config": cfg})
                row += f"{t:>14.0f}us"
            inv = invariance(impl, norms, *caches["invariance"], qkv)
            print(row + f"  {err:.2e} {inv} ({time.perf_counter() - t0:.0f} s)", flush=True)
            results[-1].update(err=err, invariance=inv)
        except Exception as e:  # a tile that does not fit (shared memory, registers): reported, the sweep goes on
            print(f"{vname:<18} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
    make_impl(None)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
